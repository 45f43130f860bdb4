"""What a CUDA graph capture of the static-slot step needs, checked on the CPU (issue 53, stage 3).

The static-slot runner's step region (``StaticSlotRunner.forward_static``),
with rows padded to a bucket and keys read to a multiple of 16 positions, on
the torch attention (CUDA's path): the ATen calls of consecutive steps in one
bucket are the same calls (operation, shapes, types), none reads a value
back or shapes its output by values, and the host reads nothing. A graph
captured once per bucket could then replay every such step. The decodes
themselves equal the lean runner's (tests/test_static_slots.py).
"""

import pytest
import torch

from conftest import decoder_options, sorted_batches
from fairseq_stream.decoder import BeamDecoder
from fairseq_stream.host_sync import HostSyncCounter, OpTrace
from fairseq_stream.schedule.pool import StreamPool

ROW_BUCKETS = (8, 16, 32, 64, 128)
LENGTH_BUCKET = 16


def traced(runner):
    """Wrap ``runner.forward_static``: one (bucket, ATen calls, host syncs) record per step."""
    records = []
    forward = runner.forward_static

    def step(tokens, slot, sentence, length, positions):
        with HostSyncCounter() as syncs, OpTrace() as trace:
            out = forward(tokens, slot, sentence, length, positions)
        # A graph is captured per bucket and pool shape (the pool grows, rarely, at the first batches).
        records.append(((slot.numel(), positions, runner.pool.shape), trace.calls, syncs.count))
        return out

    runner.forward_static = step
    return records


def decode_traced(exact, name, search, stream, stack=None):
    """The records of a traced decode of 24 sentences (``stack``: the runner's ``stack_members``)."""
    models, task = exact(name)
    dec = BeamDecoder(models, task.target_dictionary, runner="static", keep_reference=False, stack_members=stack,
                      **decoder_options(search))
    dec.runner.compiled_attention = False
    dec.runner.row_buckets, dec.runner.length_bucket = ROW_BUCKETS, LENGTH_BUCKET
    records = traced(dec.runner)
    batches = sorted_batches(task, 8, 24)
    with torch.no_grad():
        if stream:
            pool = StreamPool(dec, pool_size=8, eps=1 / 2, order="fifo")
            out = dict(pool.run(dec.open(s["net_input"], ids=s["id"]) for s in batches))
        else:
            out = {i: h for s in batches for i, h in zip(s["id"].tolist(), dec.generate(models, s))}
    assert len(out) == 24
    return records


@pytest.mark.parametrize("stream", [False, True], ids=["batch", "topup"])
@pytest.mark.parametrize("search", ["fixed", "var-batch", "greedy"])
@pytest.mark.parametrize("name", ["transformer", "ensemble"])
def test_steps_in_one_bucket_make_the_same_aten_calls_and_read_nothing(exact, name, search, stream):
    records = decode_traced(exact, name, search, stream)
    counts = checked_counts(records)
    print("{} {} {}: ATen calls per step {} over {} steps, {} buckets".format(
        name, search, "topup" if stream else "batch", counts, len(records), len({b for b, _, _ in records})))


def checked_counts(records):
    """What a graph needs of traced steps (nothing read, nothing shaped by values, the same calls for steps in
    one bucket); the step's ATen call counts seen."""
    assert all(syncs == 0 for _, _, syncs in records)
    flagged = {c.op for _, calls, _ in records for c in calls if c.data_dependent}
    assert not flagged, flagged
    pairs = [(a, b) for a, b in zip(records, records[1:]) if a[0] == b[0]]
    assert len(pairs) >= len(records) // 2  # most steps stay in their bucket
    for (bucket, calls, _), (_, next_calls, _) in pairs:
        assert calls == next_calls, bucket
    return sorted({len(calls) for _, calls, _ in records})


def test_reorders_of_quiet_steps_make_the_same_aten_calls_and_read_nothing(exact):
    """The search's reorder (bookkeeping a graph of the whole step would hold too): in quiet steps with as many
    rows, sentences and owned slots, in one position bucket, the same calls and nothing read; in no reorder
    a data-dependent call (its copy list is padded to rows minus sentences)."""
    models, task = exact("transformer")
    dec = BeamDecoder(models, task.target_dictionary, runner="static", keep_reference=False,
                      **decoder_options("fixed"))
    runner = dec.runner
    runner.compiled_attention = False
    runner.row_buckets, runner.length_bucket = ROW_BUCKETS, LENGTH_BUCKET
    records, reorder = [], runner.reorder

    def traced(state, order, sentence_rows=None):
        key = (order.numel(), len(state.holding.sentences), sum(1 for c in sentence_rows or () if c),
               state.owned.numel(), runner.pool.shape, runner._positions(state.longest))
        with HostSyncCounter() as syncs, OpTrace() as trace:
            reorder(state, order, sentence_rows)
        records.append((key, trace.calls, syncs.count))

    runner.reorder = traced
    with torch.no_grad():
        for s in sorted_batches(task, 8, 24):
            dec.generate(models, s)
    # Steps where no sentence ended: as many sentences before as after.
    quiet = [r for r in records if r[0][1] == r[0][2]]
    assert all(syncs == 0 for _, _, syncs in quiet)
    assert not [c.op for _, calls, _ in records for c in calls if c.data_dependent]
    pairs = [(a, b) for a, b in zip(quiet, quiet[1:]) if a[0] == b[0]]
    assert len(pairs) >= len(quiet) // 2
    assert all(a[1] == b[1] for a, b in pairs)
    print("reorder: ATen calls {} over {} quiet reorders".format(sorted({len(c) for _, c, _ in quiet}), len(quiet)))
