"""``--generator topup`` (Marian's top-up batching) against ``--generator batch`` on the toy checkpoints.

Top-up is the streaming pool in FIFO order (every active sentence in each
decoder call) refilled at ``--topup-threshold``. Outputs are compared as the
streaming tests compare them (tests/test_stream.py): float32 runs must print
the same best hypotheses; float64 exactness of the pool's FIFO order is
tested there.
"""

import pytest

from conftest import decode, differences, generate_in_process, hypotheses, run_tool, sorted_batches
from fairseq_stream.decoder import BeamDecoder
from fairseq_stream.schedule.pool import StreamPool
from fairseq_stream.search.pruning import Pruning


def printed(toy, capsys, *args, path=None):
    generate_in_process([toy.data_bin, "--path", path or toy.transformer, "--user-dir", "fairseq_stream",
                         "--gen-subset", "test", "--batch-size", "8", "--cpu"] + list(args))
    return {sid: text for sid, (_, text) in hypotheses(capsys.readouterr().out).items()}


@pytest.mark.parametrize("model,search", [
    ("transformer", ("greedy",)),
    ("transformer", ("var-batch", "--beam", "50")),
    ("lstm", ("fixed", "--beam", "5")),
    ("ensemble", ("fixed", "--beam", "5")),
])
def test_topup_prints_what_batch_prints(toy, capsys, model, search):
    path = {"transformer": toy.transformer, "lstm": toy.lstm,
            "ensemble": "{}:{}".format(toy.transformer, toy.transformer2)}[model]
    args = ["--search"] + list(search)
    ref = printed(toy, capsys, *args, path=path)
    ours = printed(toy, capsys, *args, "--generator", "topup", "--stream-pool", "8", path=path)
    assert len(ours) == 37
    assert ours == ref


@pytest.mark.parametrize("threshold", [1 / 2, 1 / 4])
def test_topup_refills_only_when_the_batch_is_that_empty(loaded, threshold):
    models, task = loaded("transformer")
    dec = BeamDecoder(models, task.target_dictionary, beam_size=1, runner="lean", keep_reference=False)
    pool = StreamPool(dec, 8, eps=threshold, order="fifo")
    active_at_refill = []
    refill = pool._refill

    def recording(source, staging, cohorts, hold=False):
        active_at_refill.append(sum(c.size for c in cohorts))
        return refill(source, staging, cohorts, hold)

    pool._refill = recording  # records, then the real refill runs
    batches = sorted_batches(task, 4, 100, "valid")
    out = dict(pool.run(dec.open(b["net_input"], ids=b["id"]) for b in batches))
    assert sorted(out) == list(range(100))
    assert len(active_at_refill) > 10
    assert max(active_at_refill) <= threshold * 8


def test_topup_options_are_checked(toy):
    common = ["fairseq-generate", toy.data_bin, "--path", toy.transformer, "--user-dir", "fairseq_stream",
              "--gen-subset", "test", "--search", "greedy", "--generator", "topup", "--cpu"]
    proc = run_tool(common + ["--stream-eps", "1/3"], check=False)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].endswith(
        "--generator topup refills at --topup-threshold (default 1/2); --stream-eps is --generator stream's "
        "and fifo's")
    proc = run_tool(common + ["--topup-threshold", "3/2"], check=False)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].endswith("--topup-threshold must be in (0, 1], got 3/2")


def input_order_batches(task, size, limit, subset="valid"):
    """Batches of ``subset`` in input order (sources of mixed lengths, as ``--maxi-batch 1`` makes)."""
    dataset = task.dataset(subset)
    n = min(limit, len(dataset))
    return [dataset.collater([dataset[i] for i in range(j, min(j + size, n))]) for j in range(0, n, size)]


JOINED_SEARCHES = {
    "fixed": dict(beam_size=5, finalize="fairseq"),
    "var-batch": dict(beam_size=5, finalize="stay", pruning=Pruning(ap=1.5, mc=5)),
    "greedy": dict(beam_size=1, finalize="fairseq"),
}


@pytest.mark.parametrize("model,runner", [("transformer", "lean"), ("lstm", "rnn"), ("ensemble", "lean")])
@pytest.mark.parametrize("search", sorted(JOINED_SEARCHES))
@pytest.mark.parametrize("lengths", [dict(), dict(min_len=3, max_len_a=1, max_len_b=2)])
def test_topup_joins_cohorts_of_different_lengths_exactly(exact, model, runner, search, lengths):
    """Top-up's cohorts join across steps (one search update per call); n-best as batch decoding, float64.

    ``lengths``: ``--min-len`` keeps fresh cohorts apart for their first
    steps (calls then mix joined and separate cohorts), and a short maximum
    length ends many sentences there (the joined cohort's shifted limits).
    """
    models, task = exact(model)
    samples = input_order_batches(task, 8, 60)

    def decoder():
        return BeamDecoder(models, task.target_dictionary, runner=runner, keep_reference=False,
                           **JOINED_SEARCHES[search], **lengths)

    ref = decode(decoder(), models, samples, None)
    dec = decoder()
    starts = []
    update = dec.books.update

    def recording(c, out):
        starts.append(len(set(c.start_host)) if c.mixed else 1)
        return update(c, out)

    dec.books.update = recording  # records how many starts each updated cohort holds; the real update runs
    ours = decode(dec, models, samples, dict(pool_size=8, eps=1 / 2, order="fifo"))
    assert not differences(ref, ours)
    assert max(starts) > 1, "no cohort joined sentences of different lengths"


def test_topup_keeps_cohorts_apart_when_asked(exact):
    """``StreamPool(join_lengths=False)`` (the benchmark's comparison): one update per cohort, same output."""
    models, task = exact("transformer")
    samples = input_order_batches(task, 8, 40)
    dec = BeamDecoder(models, task.target_dictionary, runner="lean", keep_reference=False,
                      **JOINED_SEARCHES["fixed"])
    ref = decode(dec, models, samples, None)
    mixed = []
    update = dec.books.update

    def recording(c, out):
        mixed.append(c.mixed)
        return update(c, out)

    dec.books.update = recording  # records whether each updated cohort was joined; the real update runs
    ours = decode(dec, models, samples, dict(pool_size=8, eps=1 / 2, order="fifo", join_lengths=False))
    assert not differences(ref, ours)
    assert mixed and not any(mixed)


@pytest.mark.parametrize("pool_size, threshold", [(8, "1/2"), (8, "1/4")])
def test_topup_refills_when_exactly_the_threshold_is_live(loaded, pool_size, threshold):
    """``--topup-threshold``: top up when at most that fraction of the batch is live, the boundary included.

    The boundary is pinned by the setup, not by where the toy's translations
    happen to end (the toy is trained per machine; on another CPU they end
    elsewhere): ``min_len = max_len = N`` makes every sentence finish exactly
    N+1 calls after its first step, and a capacity of ``n - t·n`` rows (one
    row a sentence, greedy) splits the first fill into a cohort of
    ``n - t·n`` sentences and one of ``t·n``: FIFO runs the longest prefixes
    first, so the first cohort decodes to its end while the other waits, and
    exactly ``t·n`` sentences are live when it finishes. The input comes one
    sentence a batch, so that the cohorts are cut by the capacity alone.
    """
    from fairseq_stream.schedule.topup import TopupOptions, pool_settings
    from test_stream import assert_refills_at_the_threshold, refill_decisions

    models, task = loaded("transformer")
    steps = 4
    dec = BeamDecoder(models, task.target_dictionary, beam_size=1, runner="lean", keep_reference=False,
                      max_len_a=0, max_len_b=steps, min_len=steps)
    settings = pool_settings(TopupOptions(topup_threshold=threshold))
    live_at_boundary = settings["eps"] * pool_size
    settings["capacity"] = int(pool_size - live_at_boundary) * dec.first_step_rows
    pool = StreamPool(dec, pool_size, **settings)
    decisions = refill_decisions(pool, sorted_batches(task, 1, 40, "valid"))
    assert_refills_at_the_threshold(decisions, live_at_boundary)


@pytest.mark.parametrize("threshold", ["1/2", "1/4"])
def test_topup_refill_decisions_follow_the_threshold_on_free_running_translations(loaded, threshold):
    """The same rule where the translations end where the model says (no boundary pinned), top-up as it runs."""
    from fairseq_stream.schedule.topup import TopupOptions, pool_settings
    from test_stream import assert_refills_at_the_threshold, refill_decisions

    models, task = loaded("transformer")
    dec = BeamDecoder(models, task.target_dictionary, beam_size=1, runner="lean", keep_reference=False)
    settings = pool_settings(TopupOptions(topup_threshold=threshold))
    pool = StreamPool(dec, 8, **settings)
    decisions = refill_decisions(pool, sorted_batches(task, 4, 100, "valid"))
    assert_refills_at_the_threshold(decisions, settings["eps"] * 8, pinned=False)
