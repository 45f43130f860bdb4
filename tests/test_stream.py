"""Streaming (``--generator stream``) against ``--generator batch`` on real toy checkpoints.

How outputs are compared. A pool decodes a sentence in decoder calls of other
sizes and with extra masked source positions, so float32 results differ in
the last bits (up to about 3e-5 in a cumulative score at k=50), exactly as
they do in fairseq itself when ``--batch-size`` changes. Where two candidates
for the k-th place of a beam are closer than that, the two runs can keep
different ones, and the n-best lists then differ from there on (seen once: a
2-model ensemble at k=50, two candidates 7.6e-6 apart at step 21). So:

* **exactness** is tested with the models in float64 (fairseq still takes
  its attention softmax and output log-softmax in float32, so the noise
  shrinks to about 1e-7 rather than vanishing): every sentence's n-best token
  sequences must be identical, in order, and scores equal to 1e-6 (they are
  stored in float32);
* **float32**, the precision users run, is tested on what fairseq-generate
  prints by default: every sentence's best hypothesis must be identical.
"""


import copy
import json
import random
import subprocess
import sys

import pytest
import torch

from conftest import REPO, hypotheses, run_tool, sorted_batches, tool_env
from fairseq_stream.decoder import BeamDecoder
from fairseq_stream.errors import FairseqStreamError
from fairseq_stream.schedule.pool import StreamPool
from fairseq_stream.search.pruning import Pruning

SEARCHES = {
    "var-batch": dict(finalize="stay", pruning=Pruning(ap=1.5, mc=5)),
    "fixed": dict(finalize="fairseq"),
    "fixed-stay": dict(finalize="stay"),
}


def batches(task, size, limit):
    """fairseq's length-sorted batches of the valid set, sentences with id < limit only."""
    return sorted_batches(task, size, limit, subset="valid")


def decoder(models, task, search, beam):
    return BeamDecoder(models, task.target_dictionary, beam_size=beam, **SEARCHES[search])


def by_batch(dec, models, samples):
    out = {}
    with torch.no_grad():
        for s in samples:
            out.update(zip(s["id"].tolist(), dec.generate(models, s)))
    return out


def by_stream(dec, samples, **pool_args):
    pool = StreamPool(dec, **pool_args)
    with torch.no_grad():
        out = {}
        for sid, hyps in pool.run(dec.open(s["net_input"], ids=s["id"]) for s in samples):
            assert sid not in out, "sentence {} produced twice".format(sid)
            out[sid] = hyps
    return out, pool


def assert_same(ref, ours, exact=True):
    """Every sentence exactly once; n-best identical (``exact``, float64) or the best one (float32)."""
    assert sorted(ref) == sorted(ours), "not every sentence came out exactly once"
    if exact:
        differing = [sid for sid in ref
                     if [h["tokens"].tolist() for h in ref[sid]] != [h["tokens"].tolist() for h in ours[sid]]]
    else:
        differing = [sid for sid in ref if not torch.equal(ref[sid][0]["tokens"], ours[sid][0]["tokens"])]
    assert not differing, "{} of {} sentences differ in tokens: {}".format(len(differing), len(ref), differing[:10])
    tolerance = 1e-6 if exact else 1e-4
    for sid in ref:
        for a, b in zip(ref[sid], ours[sid]):
            assert abs(float(a["score"]) - float(b["score"])) < tolerance
            if not exact:
                break


@pytest.fixture(scope="module")
def reference(loaded, exact):
    """``reference(model, search, beam, precision, limit)``: batch decoding of the valid set, computed once."""
    cache = {}

    def ref(model, search, beam, precision, limit):
        key = (model, search, beam, precision, limit)
        if key not in cache:
            models, task = (exact if precision == "float64" else loaded)(model)
            cache[key] = by_batch(decoder(models, task, search, beam), models, batches(task, 8, limit))
        return cache[key]

    return ref


# k=50 on the LSTM and the ensemble repeats the transformer's k=50 path at several times its cost: slow.
@pytest.mark.parametrize("model, beam", [
    (model, beam) if beam == 5 or model == "transformer" else pytest.param(model, beam, marks=pytest.mark.slow)
    for beam in (5, 50) for model in ("transformer", "lstm", "ensemble")
])
@pytest.mark.parametrize("search, precision", [
    ("var-batch", "float64"), ("fixed", "float64"),
    ("var-batch", "float32"),  # what --search var-stream runs
])
def test_stream_gives_batch_output(loaded, exact, reference, model, search, beam, precision):
    """The ε the paper tried, input several times the pool, same output as batch."""
    models, task = (exact if precision == "float64" else loaded)(model)
    limit = 120 if beam == 5 else 40
    samples = batches(task, 8, limit)
    ref = reference(model, search, beam, precision, limit)
    # The sweep over the paper's ε at k=5; at k=50 (3x the time per pass) its ε=1/6 only.
    for eps in (1 / 12, 1 / 6, 1 / 4) if beam == 5 else (1 / 6,):
        ours, pool = by_stream(decoder(models, task, search, beam), samples, pool_size=8, eps=eps)
        assert_same(ref, ours, exact=precision == "float64")
        assert pool.decoder.stats.refills > 1


@pytest.mark.parametrize("options", [
    dict(refill_unit="rows"),
    dict(capacity=7, capacity_unit="rows"),
    dict(capacity=60, capacity_unit="tokens"),
    dict(max_wait=3),
    dict(max_wait=1),  # overdue cohorts padded into nearly every call
    dict(eps=1.0),
])
def test_stream_options_keep_output(exact, reference, options):
    models, task = exact("transformer")
    samples = batches(task, 8, 120)
    ref = reference("transformer", "var-batch", 5, "float64", 120)
    ours, _ = by_stream(decoder(models, task, "var-batch", 5), samples, pool_size=8, **options)
    assert_same(ref, ours)


@pytest.mark.parametrize("model", ["transformer", "lstm", "ensemble"])
@pytest.mark.parametrize("options", [dict(), dict(capacity=20), dict(capacity=100, capacity_unit="tokens"),
                                     dict(capacity=20, max_wait=2)])
def test_fifo_pads_mixed_lengths_exactly(exact, reference, model, options):
    """VAR-STR-FIFO: one decoder call over prefixes of different lengths, same output as batch.

    Lengths mix where a refill comes while sentences still decode. At ε=1/6
    (a refill at one live sentence or none) that took one still decoding at
    4 to 12 of the 16 refills, as the toy (trained per machine) happened to
    end its translations; at ε=1/2 a refill finds none only where 5 or more
    end in one call, and 23 runs of mixed calls or more came on the toys seen.
    """
    models, task = exact(model)
    samples = batches(task, 8, 120)
    ref = reference(model, "var-batch", 5, "float64", 120)
    dec = decoder(models, task, "var-batch", 5)
    mixed = []
    step_mixed = dec.runner.step_mixed

    def counting(states, *args):
        mixed.append(len(states))
        return step_mixed(states, *args)

    dec.runner.step_mixed = counting  # counts calls; the real method runs
    ours, _ = by_stream(dec, samples, pool_size=8, eps=1 / 2, order="fifo", **options)
    assert_same(ref, ours)
    assert mixed, "no decoder call mixed prefix lengths"


def test_fixed_stay_streams(exact):
    models, task = exact("transformer")
    samples = batches(task, 8, 60)
    ref = by_batch(decoder(models, task, "fixed-stay", 5), models, samples)
    ours, _ = by_stream(decoder(models, task, "fixed-stay", 5), samples, pool_size=5)
    assert_same(ref, ours)


@pytest.mark.parametrize("search", ["var-batch", "fixed"])
@pytest.mark.parametrize("model", ["transformer", "lstm"])
def test_stream_keeps_each_batch_max_len_a(exact, model, search):
    """--max-len-a 0.5 --max-len-b 2 binds: each sentence keeps its own batch's limit in the pool."""
    models, task = exact(model)
    samples = batches(task, 8, 120)
    make = lambda: BeamDecoder(models, task.target_dictionary, beam_size=5, max_len_a=0.5, max_len_b=2,
                               **SEARCHES[search])
    ref = by_batch(make(), models, samples)
    ours, pool = by_stream(make(), samples, pool_size=8, eps=1 / 6)
    assert_same(ref, ours)
    assert pool.decoder.stats.refills > 1
    limit = lambda s: int(0.5 * s["net_input"]["src_tokens"].size(1) + 2)  # the batch's padded width
    cut = [sid for s in samples for sid in s["id"].tolist()
           if any(h["tokens"].numel() == limit(s) + 1 for h in ref[sid])]
    assert len(cut) >= 10  # of 120: the limit binds


def test_capacity_bounds_each_decoder_call(loaded):
    models, task = loaded("transformer")
    dec = decoder(models, task, "var-batch", 5)
    dec.stats.keep_steps = True
    by_stream(dec, batches(task, 8, 80), pool_size=16, capacity=9)
    rows = [r for _, r, _ in dec.stats.steps]
    assert max(rows) <= 9 or all(r <= 5 for r in rows if r > 9)  # a lone sentence may exceed it


def test_latency_guard_bounds_lag(loaded):
    models, task = loaded("transformer")
    samples = batches(task, 8, 120)
    _, free = by_stream(decoder(models, task, "var-batch", 5), samples, pool_size=8, eps=1 / 4, max_wait=0)
    _, guarded = by_stream(decoder(models, task, "var-batch", 5), samples, pool_size=8, eps=1 / 4, max_wait=3)
    assert free.decoder.stats.peak_lag > 3
    assert guarded.decoder.stats.peak_lag <= 3


LONG_WORDS = 39


def long_first(toy, count):
    """One sentence several times longer than the rest first (``LONG_WORDS`` words), then ``count`` of at most 8."""
    rng = random.Random(0)
    long_line = " ".join("s{}".format(rng.randrange(60, 300)) for _ in range(LONG_WORDS))
    short = [l for l in (toy.raw / "valid.src").read_text().splitlines() if len(l.split()) <= 8]
    return [long_line] + [short[i % len(short)] for i in range(count)]


@pytest.mark.parametrize("max_wait", [None, 0])
def test_a_long_sentence_is_not_starved_by_default(toy, max_wait):
    """Shortest-first lets fresh short sentences go ahead of a long one; the default guard bounds that.

    Every output length is pinned by the setup, not by where the toy's
    translations happen to end (the toy is trained per machine: its
    translation of a long line ran 25 tokens on one, more on others, and at
    150 tokens it would outlast the input and be held to the end even with
    the guard). An unk bonus of 1000 makes <unk> each row's best word by
    far: var-stream's pruning keeps that one row and no EOS, so each
    sentence runs to its maximum length, ``1 x its source width``
    (``--max-len-a 1 --max-len-b 0``, one sentence a batch so that the width
    is its own): the long sentence 41 tokens with EOS, the short ones 3 to 10.
    """
    from fairseq_stream.api import Translator
    from fairseq_stream.schedule.pool import DEFAULT_MAX_WAIT

    inputs = long_first(toy, 240)
    options = {} if max_wait is None else dict(stream_max_wait=max_wait)
    translator = Translator([str(toy.transformer)], data=str(toy.data_bin), beam=5, pool=16, batch_size=1,
                            unkpen=-1000, max_len_a=1, max_len_b=0, **options)
    order, calls_at_end, lengths = [], None, {}
    for t in translator.translate(inputs):
        order.append(t.index)
        lengths[t.index] = len(t.hypotheses[0]["tokens"])
        if t.index == 0:
            calls_at_end, refills_by_then = translator.stats.timesteps, translator.stats.refills
    assert sorted(order) == list(range(len(inputs)))
    # The scenario, pinned: each output its maximum length (the source's words and EOS, then EOS), so the
    # long sentence needs several times a short one's steps.
    assert lengths == {i: len(line.split()) + 2 for i, line in enumerate(inputs)}
    long_length = lengths.pop(0)
    assert long_length == LONG_WORDS + 2 >= 4 * max(lengths.values())
    if max_wait == 0:
        assert order[-1] == 0  # without a guard it comes out last: the scenario starves it
        return
    stats = translator.stats
    assert stats.peak_lag <= DEFAULT_MAX_WAIT
    # Its own steps, at most the guard's calls passed over, and one first-step call per refill.
    assert calls_at_end <= long_length + DEFAULT_MAX_WAIT + refills_by_then
    # Not held to the end: at least a pool's worth of later sentences finishes after it.
    assert len(order) - 1 - order.index(0) >= 16


def test_fairseq_generate_read_ahead_is_bounded(toy, tmp_path):
    """Finished translations of later batches wait in a cache; reading ahead stops at its limit."""
    def run(*extra):
        stats = tmp_path / "stats.json"
        proc = run_tool(["fairseq-generate", toy.data_bin, "--path", toy.transformer, "--user-dir", "fairseq_stream",
                         "--gen-subset", "valid", "--beam", "5", "--batch-size", "8", "--cpu", "--search", "var-stream",
                         "--stats-file", stats] + list(extra))
        return tokens_of(proc.stdout), json.loads(stats.read_text())

    ref, default = run()
    limited, small = run("--stream-max-cached", "2")
    assert len(ref) == 200 and limited == ref
    assert default["peak_cached"] <= 4 * 8 + 8 + 8  # the limit, the pool's sentences and one staged batch
    assert small["peak_cached"] <= 2 + 8 + 8
    assert small["peak_cached"] < default["peak_cached"]


# fairseq-generate with torch's DataLoader worker join timeout (5 s) raised to 10 minutes: a
# DataLoader left to the cyclic garbage collector with its worker alive then hangs the run.
GENERATE_WITH_A_LONG_WORKER_JOIN = (
    "import torch.utils.data._utils as u; u.MP_STATUS_CHECK_INTERVAL = 600.0; "
    "from fairseq_cli.generate import cli_main; cli_main()"
)


@pytest.mark.parametrize("generator", ["stream", "fifo"])
def test_a_one_batch_look_ahead_never_waits_on_a_data_loader_worker(toy, generator):
    """All sentences in one batch (no --batch-size): the look-ahead ends mid-run, without a stall (issue 49.2).

    Its DataLoader used to keep a worker process; collected mid-decode by the
    cyclic garbage collector, it cost torch's worker join timeout, 5 s on a
    0.1 s decode. With that timeout raised to 600 s, such a run would not
    finish within the 300 s allowed here (a normal one takes seconds).
    """
    argv = [sys.executable, "-c", GENERATE_WITH_A_LONG_WORKER_JOIN, toy.data_bin, "--path", toy.transformer,
            "--user-dir", "fairseq_stream", "--gen-subset", "test", "--beam", "5", "--cpu",
            "--search", "var", "--generator", generator, "--num-workers", "1"]
    proc = subprocess.run([str(a) for a in argv], cwd=REPO, env=tool_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(tokens_of(proc.stdout)) == 37


def test_pool_memory_is_bounded_by_the_pool_not_the_input(loaded):
    """200 sentences through a pool of 4: at most the pool plus one encoded batch are held."""
    models, task = loaded("transformer")
    samples = batches(task, 8, 10 ** 9)
    assert sum(s["id"].numel() for s in samples) == 200
    ours, pool = by_stream(decoder(models, task, "var-batch", 5), samples, pool_size=4)
    assert len(ours) == 200
    assert pool.peak_sentences <= 4 + 8


@pytest.mark.parametrize("bad", [dict(eps=0.0), dict(eps=1.5), dict(pool_size=0),
                                 dict(capacity=0), dict(max_wait=-1), dict(refill_unit="words")])
def test_bad_pool_options_are_refused(loaded, bad):
    models, task = loaded("transformer")
    args = dict(pool_size=4)
    args.update(bad)
    with pytest.raises(FairseqStreamError):
        StreamPool(decoder(models, task, "var-batch", 5), **args)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("model", ["transformer", "ensemble"])
@pytest.mark.parametrize("beam", [5, 50])
@pytest.mark.parametrize("precision", ["float64", "float32"])
def test_stream_and_fifo_give_batch_output_on_cuda(loaded, exact, model, beam, precision):
    """The same comparisons with models and state on the GPU (gathers, padding, position hook)."""
    from fairseq import utils

    cpu_models, task = (exact if precision == "float64" else loaded)(model)
    models = [copy.deepcopy(m).cuda() for m in cpu_models]
    samples = [utils.move_to_cuda(s) for s in batches(task, 8, 120 if beam == 5 else 40)]
    ref = by_batch(decoder(models, task, "var-batch", beam), models, samples)
    for order in ("shortest", "fifo"):
        ours, _ = by_stream(decoder(models, task, "var-batch", beam), samples, pool_size=8, eps=1 / 6,
                            order=order)
        assert_same(ref, ours, exact=precision == "float64")


# -- the command-line tools ---------------------------------------------------


def generate(toy, *args, path=None):
    return run_tool(["fairseq-generate", toy.data_bin, "--path", path or toy.transformer,
                     "--user-dir", "fairseq_stream", "--gen-subset", "test", "--beam", "5",
                     "--batch-size", "8"] + list(args))


def tokens_of(stdout):
    return {sid: text for sid, (_, text) in hypotheses(stdout).items()}


@pytest.fixture(scope="module")
def var_batch_cli(toy):
    """fairseq-generate --search var-batch on the toy test set: {id: text}, run once for the module."""
    return tokens_of(generate(toy, "--search", "var-batch").stdout)


def test_fairseq_generate_streams_across_batches(toy, var_batch_cli, tmp_path):
    stats = tmp_path / "stats.json"
    ours = generate(toy, "--search", "var-stream", "--stream-pool", "8", "--stats-file", stats)
    assert tokens_of(ours.stdout) == var_batch_cli
    assert len(tokens_of(ours.stdout)) == 37
    assert "Translated 37 sentences" in ours.stderr
    # Refills after the first mean later batches were read ahead.
    assert json.loads(stats.read_text())["refills"] > 1


def test_fixed_stream_and_ensemble_on_the_command_line(toy):
    ensemble = "{}:{}".format(toy.transformer, toy.transformer2)
    ref = generate(toy, "--search", "fixed", path=ensemble)
    ours = generate(toy, "--search", "fixed", "--generator", "stream", "--stream-eps", "1/4", path=ensemble)
    assert tokens_of(ours.stdout) == tokens_of(ref.stdout)


def test_fifo_on_the_command_line(toy):
    ref = generate(toy, "--search", "var-batch", path=toy.lstm)
    ours = generate(toy, "--search", "var", "--prune-ap", "1.5", "--prune-mc", "5",
                    "--generator", "fifo", "--stream-pool", "8", path=toy.lstm)
    assert tokens_of(ours.stdout) == tokens_of(ref.stdout)


def test_within_batch_option(toy, var_batch_cli):
    ours = generate(toy, "--search", "var-stream", "--stream-within-batch", "--stream-pool", "3")
    assert tokens_of(ours.stdout) == var_batch_cli


def test_fairseq_interactive_streams_within_the_buffer(toy):
    lines = (toy.raw / "test.src").read_text()
    common = ["fairseq-interactive", toy.data_bin, "--path", toy.transformer, "--user-dir",
              "fairseq_stream", "--beam", "5", "--buffer-size", "37", "--batch-size", "37"]
    ref = run_tool(common + ["--search", "var-batch"], input=lines)
    ours = run_tool(common + ["--search", "var-stream", "--stream-pool", "5"], input=lines)
    assert tokens_of(ours.stdout) == tokens_of(ref.stdout)
    assert len(tokens_of(ours.stdout)) == 37


def test_python_api_streams_an_iterator(toy, var_batch_cli):
    from fairseq_stream.api import Translator

    ref = var_batch_cli
    lines = (toy.raw / "test.src").read_text().splitlines()
    translator = Translator([str(toy.transformer)], data=str(toy.data_bin), beam=5, pool=4, batch_size=8)
    results = list(translator.translate(iter(lines + [""])))
    assert sorted(r.index for r in results) == list(range(38))
    by_index = {r.index: r for r in results}
    assert {i: by_index[i].text for i in range(37)} == ref
    assert by_index[37].text == "" and by_index[37].source == ""
    assert translator.stats.refills > 1


# -- when the pool refills: at ε·n exactly, not only below it (issue 32, item 10) -------


def refill_decisions(pool, batches):
    """Run ``pool`` over ``batches``; return [(live sentences, refilled)] at every step while input remained.

    The pool asks whether to refill before each decoder call until its input
    runs out; the recording wraps that question and the refill itself, and
    the real ones run.
    """
    dec = pool.decoder
    decisions = []
    should_refill, refill = pool._should_refill, pool._refill

    def asking(cohorts):
        decisions.append([pool._active(cohorts), False])
        return should_refill(cohorts)

    def refilling(source, staging, cohorts, hold=False):
        decisions[-1][1] = True
        return refill(source, staging, cohorts, hold)

    pool._should_refill, pool._refill = asking, refilling
    out = dict(pool.run(dec.open(b["net_input"], ids=b["id"]) for b in batches))
    assert sorted(out) == sorted(i for b in batches for i in b["id"].tolist())
    return [tuple(d) for d in decisions]


def assert_refills_at_the_threshold(decisions, threshold, pinned=True):
    """A refill exactly where at most ``threshold`` sentences are live, and (``pinned``) the boundary was met."""
    assert threshold == int(threshold)  # the boundary is a whole number of sentences here
    wrong = [(live, refilled) for live, refilled in decisions if refilled != (live <= threshold)]
    assert wrong == [], "refill decisions against {} live sentences: {}".format(threshold, wrong)
    if pinned:
        assert (int(threshold), True) in decisions, "the run never had exactly the threshold live: not pinned"


@pytest.mark.parametrize("pool_size, eps", [(6, "1/6"), (12, "1/4")])
def test_stream_refills_when_exactly_eps_times_the_pool_is_live(loaded, pool_size, eps):
    """``--stream-eps``: refill when at most ε·n sentences are live (Algorithm 1's ≤), not only below.

    The boundary is pinned by the setup, not by where the toy's translations
    happen to end (the toy is trained per machine; on another CPU they end
    elsewhere): ``min_len = max_len = N`` makes every sentence finish exactly
    at its N+1-th decoder call, and a capacity of ``n - ε·n`` sentences'
    rows splits the first fill into a cohort of ``n - ε·n`` sentences and one
    of ``ε·n``, which runs one call behind (shortest first, ties in list
    order; the input comes one sentence a batch, so that the cohorts are cut
    by the capacity alone). When the first cohort finishes, exactly ``ε·n`` sentences are live.
    """
    from fairseq_stream.schedule.stream import StreamOptions, pool_settings

    models, task = loaded("transformer")
    steps, k = 4, 5
    dec = BeamDecoder(models, task.target_dictionary, beam_size=k, finalize="fairseq", runner="lean",
                      keep_reference=False, max_len_a=0, max_len_b=steps, min_len=steps)
    settings = pool_settings(StreamOptions(stream_eps=eps))
    threshold = settings["eps"] * pool_size
    settings["capacity"] = int(pool_size - threshold) * dec.first_step_rows
    pool = StreamPool(dec, pool_size, **settings)
    # One sentence a batch: the first fill joins up to the capacity, whatever fairseq's batches would hold.
    decisions = refill_decisions(pool, sorted_batches(task, 1, 40, "valid"))
    assert_refills_at_the_threshold(decisions, threshold)


def test_stream_refill_decisions_follow_the_threshold_on_free_running_translations(loaded):
    """The same rule where the translations end where the model says (no boundary pinned)."""
    from fairseq_stream.schedule.stream import StreamOptions, pool_settings

    models, task = loaded("transformer")
    dec = BeamDecoder(models, task.target_dictionary, beam_size=5, finalize="fairseq", runner="lean",
                      keep_reference=False)
    settings = pool_settings(StreamOptions(stream_eps="1/4"))
    pool = StreamPool(dec, 12, **settings)
    decisions = refill_decisions(pool, sorted_batches(task, 4, 60, "valid"))
    assert_refills_at_the_threshold(decisions, settings["eps"] * 12, pinned=False)


# -- the API's n-best lists: fairseq's order, best first (issue 32, item 10) --------------


def fairseq_nbest(models, task, token_lists, beam):
    """fairseq's SequenceGenerator's n-best lists (best first) for source token lists, in input order."""
    from fairseq.sequence_generator import SequenceGenerator

    dataset = task.build_dataset_for_inference(token_lists, [t.numel() for t in token_lists])
    sample = dataset.collater([dataset[i] for i in range(len(token_lists))])
    with torch.no_grad():
        out = SequenceGenerator(models, task.target_dictionary, beam_size=beam).generate(models, sample)
    by_index = dict(zip(sample["id"].tolist(), out))
    return [by_index[i] for i in range(len(token_lists))]


@pytest.mark.parametrize("nbest", [None, 3])
def test_api_gives_fairseqs_nbest_lists_best_first(toy, loaded, nbest):
    from fairseq_stream.api import Translator

    sentences = (toy.raw / "test.src").read_text().splitlines()[:12]
    options = {} if nbest is None else dict(nbest=nbest)
    translator = Translator([str(toy.transformer)], data=str(toy.data_bin), search="fixed", beam=5, pool=4,
                            cpu=True, **options)
    got = {t.index: t for t in translator.translate(sentences)}
    models, task = loaded("transformer")
    ref = fairseq_nbest(models, task, [translator.encode(s) for s in sentences], beam=5)
    for i, hyps in enumerate(ref):
        ours = got[i].hypotheses
        hyps = hyps[:nbest or len(hyps)]
        assert len(ours) == len(hyps) == (nbest or 5)
        scores = [float(h["score"]) for h in ours]
        assert scores == sorted(scores, reverse=True), "sentence {}: not best first: {}".format(i, scores)
        assert [h["tokens"].tolist() for h in ours] == [h["tokens"].tolist() for h in hyps], "sentence {}".format(i)
        assert scores == pytest.approx([float(h["score"]) for h in hyps], abs=1e-4)
        assert (got[i].score, got[i].text) == (scores[0], translator.decode(ours[0]["tokens"]))
