"""Reading a step's summary N decoder calls late (late_reads.py, ``--host-lag N``; issue 53).

The toy checkpoints (the transformer and a 2-member ensemble), real
decoding: for greedy and fixed width (k=5, fairseq's finalization) under the
batch generator and the stream pool (shortest first, FIFO, and top-up, whose
cohorts of different lengths join), a lag of 1, 2 or 8 gives bitwise the
n-best lists of lag 0 (tokens, scores, positional scores), in float64 and in
float32, with the static runner's rows padded to one bucket: the rows of
sentences that ended but were not read yet still run, and without a bucket
the products' shapes change with them, which moves even float64 results in
the last bit (greedy, measured); in one bucket the shapes are lag 0's. On
the lean runner (no buckets) the tokens are lag 0's and the scores within
1e-12. The host's one read of a quiet step is of the step made N calls
before. A cohort's ids, handed on the host, are never read back through the
stream pool's splits and joins. Searches whose rows per sentence change are
refused with one line.
"""

import pytest
import torch

from conftest import decode, decoder_options, differences, sorted_batches
from fairseq_stream.decoder import BeamDecoder
from fairseq_stream.errors import FairseqStreamError
from fairseq_stream.host_sync import count_update_syncs
from test_stacked import SCHEDULERS

SENTENCES = 12
# One row bucket above every step's rows (a stream pool of 8 sentences at k=5: 40 rows): the products have the
# same shape whatever the lag leaves running.
ONE_BUCKET = (64,)

_references = {}


def lagged_decoder(models, task, search, lag, runner="static", buckets=None):
    opts = dict(decoder_options(search), output_layer="torch" if search == "fixed" else "fused")
    dec = BeamDecoder(models, task.target_dictionary, runner=runner, keep_reference=False, host_lag=lag, **opts)
    if buckets:
        dec.runner.row_buckets = buckets
    return dec


def nbest(models, task, search, scheduler, lag, runner="static", buckets=None):
    batches = sorted_batches(task, 4, SENTENCES)
    return decode(lagged_decoder(models, task, search, lag, runner, buckets), models, batches, SCHEDULERS[scheduler])


def reference(load, name, search, scheduler, runner="static", buckets=None):
    models, task = load(name)
    key = (next(models[0].parameters()).dtype, name, search, scheduler, runner, buckets)
    if key not in _references:
        _references[key] = nbest(models, task, search, scheduler, 0, runner, buckets)
    return _references[key]


def assert_bitwise(ref, ours):
    assert len(ours) == SENTENCES
    assert differences(ref, ours, tolerance=0.0) == []
    for sid in ref:
        for a, b in zip(ref[sid], ours[sid]):
            assert torch.equal(a["positional_scores"], b["positional_scores"]) and float(a["score"]) == float(b["score"])


@pytest.mark.parametrize("lag", [1, 2, 8])
@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
@pytest.mark.parametrize("search", ["greedy", "fixed"])
@pytest.mark.parametrize("name", ["transformer", "ensemble"])
@pytest.mark.parametrize("precision", ["float64", "float32"])
def test_late_reads_are_bitwise_lag_0_in_one_bucket(exact, loaded, precision, name, search, scheduler, lag):
    load = exact if precision == "float64" else loaded
    models, task = load(name)
    ref = reference(load, name, search, scheduler, buckets=ONE_BUCKET)
    assert_bitwise(ref, nbest(models, task, search, scheduler, lag, buckets=ONE_BUCKET))


@pytest.mark.parametrize("search", ["greedy", "fixed"])
def test_late_reads_on_the_lean_runner_float64(exact, search):
    """The lean runner has no buckets: the rows still running change the products' shapes, and float64 moves
    in the last bits (as it does between --batch-size values); the tokens are the same."""
    models, task = exact("transformer")
    ref = reference(exact, "transformer", search, "batch", runner="lean")
    assert differences(ref, nbest(models, task, search, "batch", 2, runner="lean"), tolerance=1e-12) == []


def counted_decode(loaded, search, lag):
    """The toy's first 16 test sentences decoded by batches of 8 at ``lag``: host_sync's record of each update
    and the late reads each made ((call that made the step, call that read it))."""
    models, task = loaded("transformer")
    dec = lagged_decoder(models, task, search, lag)
    late, update, reads_by_update = dec.late, dec.books.update, []

    def tracked(c, step_out):
        before = len(late.log)
        out = update(c, step_out)
        reads_by_update.append(late.log[before:])
        return out

    dec.books.update = tracked
    with torch.no_grad(), count_update_syncs(dec) as records:
        for s in sorted_batches(task, 8, 16):
            dec.generate(models, s)
    return records, reads_by_update


@pytest.mark.parametrize("lag", [1, 2])
def test_a_quiet_steps_one_read_is_of_an_older_step(loaded, lag):
    """host_sync counts one read in each quiet update, and the summary it reads was made ``lag`` calls before."""
    records, reads_by_update = counted_decode(loaded, "fixed", lag)
    quiet = [(r, reads) for r, reads in zip(records, reads_by_update) if r.quiet and reads]
    assert quiet
    for record, reads in quiet:
        assert record.syncs == 1 and record.events[0][0] == "tolist", record.events
        assert record.runner_syncs == 0, record.runner_events
        assert [read - made for made, read in reads] == [lag], reads
    # Only a batch's first lag updates read no summary (no step is lag calls old yet), and they read nothing at
    # all (the batch's ids came on the host).
    unread = [r for r, reads in zip(records, reads_by_update) if not reads]
    assert unread and all(r.step < lag for r in unread)
    assert all(r.syncs == 0 for r in unread)


@pytest.mark.parametrize("lag", [1, 2])
@pytest.mark.parametrize("search", ["greedy", "fixed"])
def test_an_update_in_which_sentences_end_reads_only_older_steps(loaded, search, lag):
    """Where sentences end, the host reads only the host copies made with steps ``lag`` calls before (their
    summary and finalized scores: ``_Pending.read`` and ``finals``), nothing of the device behind the step just
    launched: no scores read when the hypotheses are scored, no runner sync when their rows leave."""
    import inspect

    from fairseq_stream import late_reads

    records, reads_by_update = counted_decode(loaded, search, lag)
    ending = [(r, reads) for r, reads in zip(records, reads_by_update) if r.finished]
    assert sum(r.finished for r, _ in ending) == 16
    lines, first = inspect.getsourcelines(late_reads._Pending)
    pending_lines = range(first, first + len(lines))
    for record, reads in ending:
        assert reads and [read - made for made, read in reads] == [lag] * len(reads), reads
        for name, caller in record.events:
            path, line = caller.rsplit(":", 1)
            assert name == "tolist" and path == late_reads.__file__ and int(line) in pending_lines, record.events
        # One read a step read: its summary and its finalized scores in one host buffer.
        assert record.syncs == len(reads), record.events
        assert record.runner_syncs == 0, record.runner_events


@pytest.mark.parametrize("search,runner,message", [
    ("var-batch", "static", "rows per sentence are fixed"),
    ("fixed-stay", "static", "rows per sentence are fixed"),
    ("fixed", "fairseq", "--runner static or lean"),
])
def test_lag_is_refused_where_it_does_not_hold(loaded, search, runner, message):
    models, task = loaded("transformer")
    with pytest.raises(FairseqStreamError, match=message):
        lagged_decoder(models, task, search, 1, runner=runner)


def test_host_lag_on_the_command_line(toy, capsys):
    """``--host-lag 2`` in fairseq-generate (float32, rows in one bucket) prints lag 0's output, scores to the
    last digit; a var search refuses it in one line."""
    from conftest import generate_in_process, hypotheses

    common = [str(toy.data_bin), "--path", str(toy.transformer), "--gen-subset", "valid", "--batch-size", "8",
              "--beam", "5", "--cpu", "--user-dir", "fairseq_stream", "--runner", "static", "--search", "fixed",
              "--static-buckets", "64"]
    outs = []
    for lag in ("0", "2"):
        generate_in_process(common + ["--host-lag", lag])
        outs.append(hypotheses(capsys.readouterr().out))
    assert outs[0] == outs[1] and len(outs[0]) > 0
    with pytest.raises(FairseqStreamError, match="rows per sentence"):
        generate_in_process([a if a != "fixed" else "var-batch" for a in common] + ["--host-lag", "1"])
    jacobi = {"fixed": "jacobi", "static": "lean", "--static-buckets": "--host-lag", "64": "1"}
    with pytest.raises(FairseqStreamError, match="not for Jacobi"):
        generate_in_process([jacobi.get(a, a) for a in common])
    with pytest.raises(FairseqStreamError, match="0 or more"):
        generate_in_process(common + ["--host-lag", "-1"])


def test_the_python_api_takes_host_lag(toy):
    from fairseq_stream.api import Translator

    lines = [l for l in (toy.raw / "test.src").read_text().splitlines()[:6] if l]
    out = {}
    for lag in (0, 2):
        translator = Translator([str(toy.transformer)], data=str(toy.data_bin), search="fixed", beam=5, pool=8,
                                cpu=True, runner="static", static_buckets="64", host_lag=lag)
        out[lag] = [(t.text, t.score) for t in translator.translate(lines)]
    assert out[0] == out[2] and len(out[2]) == len(lines)
    with pytest.raises(FairseqStreamError, match="rows per sentence"):
        Translator([str(toy.transformer)], data=str(toy.data_bin), search="var-batch", cpu=True, runner="static",
                   host_lag=1)


@pytest.mark.parametrize("scheduler", ["stream", "topup"])
def test_a_cohorts_ids_are_never_read_back(loaded, scheduler):
    """Ids handed on the host (as fairseq-generate's look-ahead and the API hand them) stay on the host through
    every split, join and departure of the stream pool: the late reader never reads a cohort's ids from the
    device, and a split or join of the pool's cohorts reads nothing at all (every slot a row: fixed k=5)."""
    from fairseq_stream.host_sync import HostSyncCounter
    from fairseq_stream.schedule.pool import StreamPool

    models, task = loaded("transformer")
    dec = lagged_decoder(models, task, "fixed", 2, buckets=ONE_BUCKET)
    late, host_ids = dec.late, dec.late._host_ids
    unknown, moves = [], HostSyncCounter()

    def tracked_ids(c):
        unknown.append(c.ids_host is None)
        ids = host_ids(c)
        assert ids == c.ids.tolist()
        return ids

    def counted(method):
        def call(*args, **kwargs):
            with moves:
                return method(*args, **kwargs)
        return call

    late._host_ids = tracked_ids
    dec.split, dec.join = counted(dec.split), counted(dec.join)
    out = {}
    with torch.no_grad():
        pool = StreamPool(dec, **SCHEDULERS[scheduler])
        for sid, hyps in pool.run(dec.open(s["net_input"], ids=s["id"]) for s in sorted_batches(task, 4, SENTENCES)):
            out[sid] = hyps
    assert sorted(out) == list(range(SENTENCES))
    assert unknown and not any(unknown)
    assert moves.count == 0, moves.events
    assert_bitwise(reference(loaded, "transformer", "fixed", scheduler, buckets=ONE_BUCKET), out)
