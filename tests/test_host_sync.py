"""The search step reads the device once per step: host synchronizations counted on the CPU.

``BeamDecoder.update`` may read one small summary back to the host per step
(which sentences end, how many rows stay live); in a step where no sentence
ends it must read nothing else, whatever the search. Counted exactly by
wrapping the torch operations that synchronize on a GPU
(:mod:`fairseq_stream.host_sync`), so the test is deterministic.
"""

import contextlib
import copy
import warnings

import pytest
import torch

from conftest import DECODER_OPTIONS, decoder_options
from fairseq_stream.decoder import BeamDecoder
from fairseq_stream.host_sync import STEP_METHODS, HostSyncCounter, OpTrace, count_update_syncs
from fairseq_stream.schedule.pool import StreamPool

SEARCHES = sorted(DECODER_OPTIONS)


def batches(task, size=8):
    dataset = task.dataset("test")
    return list(task.get_batch_iterator(dataset=dataset, max_sentences=size,
                                        required_batch_size_multiple=1,
                                        disable_iterator_cache=True).next_epoch_itr(shuffle=False))


def decode_counted(decoder, models, samples, stream=False):
    """Decode ``samples``; the output and one record per ``update`` call."""
    with torch.no_grad(), count_update_syncs(decoder) as records:
        if stream:
            pool = StreamPool(decoder, 8, eps=1 / 6, refill_unit="sentences")
            out = dict(pool.run(decoder.open(s["net_input"], ids=s["id"]) for s in samples))
        else:
            out = {}
            for s in samples:
                out.update(zip(s["id"].tolist(), decoder.generate(models, s)))
    return out, records


@pytest.mark.parametrize("stream", [False, True], ids=["batch", "stream"])
@pytest.mark.parametrize("search", SEARCHES)
def test_a_step_without_ending_sentences_reads_the_device_once(loaded, search, stream):
    models, task = loaded("transformer")
    decoder = BeamDecoder(models, task.target_dictionary, **decoder_options(search))
    out, records = decode_counted(decoder, models, batches(task), stream=stream)
    assert len(out) == 37
    quiet = [r for r in records if not r.finished]
    ending = [r for r in records if r.finished]
    assert quiet and ending
    extra = [(r.step, r.events) for r in quiet if r.syncs > 1]
    assert not extra, "steps with no sentence ending synchronized more than once: {}".format(extra[:3])
    # A step where sentences end reads their hypotheses once more, whatever their number.
    assert max(r.syncs for r in ending) <= 2, [r.events for r in ending if r.syncs > 2][:3]


def test_counting_leaves_the_output_unchanged(loaded):
    models, task = loaded("transformer")
    make = lambda: BeamDecoder(models, task.target_dictionary, **decoder_options("var-batch"))
    counted, _ = decode_counted(make(), models, batches(task))
    with torch.no_grad():
        plain = {}
        for s in batches(task):
            plain.update(zip(s["id"].tolist(), make().generate(models, s)))
    assert {i: [h["tokens"].tolist() for h in hyps] for i, hyps in counted.items()} == \
        {i: [h["tokens"].tolist() for h in hyps] for i, hyps in plain.items()}


def test_counter_sees_each_kind_of_sync_and_leaves_torch_as_it_was():
    t = torch.tensor([0.5, -1.0, 2.0])
    mask = t > 0
    with HostSyncCounter() as counter:
        t.sum().item()
        if t.any():
            pass
        int(t[0]), float(t[1])
        t.tolist()
        t.nonzero()
        torch.nonzero(t)
        t[mask]
        t[mask] = 0.0
        t.masked_select(mask)
        torch.unique(t)
        torch.tensor([1, 2]).repeat_interleave(torch.tensor([1, 2]))
        t.cpu()
        torch.where(mask)
        with counter.paused():
            t.tolist()
        # Not syncs: shapes known, values stay on the device.
        t[0], t[torch.tensor([0, 2])], torch.where(mask, t, 0.0), t.topk(2)
        torch.tensor([1, 2]).repeat_interleave(2)
        t.masked_fill(mask, 1.0)
    names = [name for name, _ in counter.events]
    assert names == ["item", "__bool__", "__int__", "__float__", "tolist", "nonzero", "nonzero", "__getitem__",
                     "__setitem__", "masked_select", "unique", "repeat_interleave", "cpu", "where"]
    assert all(where.startswith(__file__) for _, where in counter.events)
    t.tolist()
    assert counter.count == len(names)
    assert not torch._C._is_torch_function_mode_enabled()


def test_counter_sees_host_to_device_copies_not_pinned_copies():
    t = torch.tensor([0.5, -1.0, 2.0])
    with HostSyncCounter() as counter:
        torch.tensor([1, 2], device=t.device)  # a Python list copied to the models' device
        torch.as_tensor([1.0], device=t.device)
        torch.tensor(3, device="cpu")
        # Not syncs: host tensors, and copies that do not wait (pinned memory on CUDA).
        torch.tensor([1, 2])
        t.to("cpu", non_blocking=True)
        torch.empty(3).copy_(t, non_blocking=True)
        torch.as_tensor(t, device=t.device)
    assert [name for name, _ in counter.events] == ["tensor", "as_tensor", "tensor"]


# The CUDA path's searches of the target: fixed and greedy in batches, var-stream through the pool.
DEVICE_SEARCHES = {"fixed": ("fixed", "batch"), "var-stream": ("var-batch", "stream"), "greedy": ("greedy", "batch"),
                   "var-fairseq": ("var-fairseq", "batch"), "fixed-stay-stream": ("fixed-stay", "stream"),
                   "top-up": ("var-batch", "top-up")}


def device_path_decode(models, task, search, schedule, sync_free, samples=None, watch=None, stack_members=None):
    """The toy decoded on the lean runner's CUDA code path (run on the CPU: the torch search step and
    attentions, the fused output layer, one call as its CUDA kernel), with the reorder without reads
    (``sync_free``) or the reading one; the output (tokens and scores, bitwise) and the step records.

    ``samples``: the batches (default: the test set's, on the CPU); ``watch(decoder, records)``: a context
    manager entered inside the counting (the CUDA test's sync check)."""
    decoder = BeamDecoder(models, task.target_dictionary, runner="lean", output_layer="auto",
                          stack_members=stack_members, **decoder_options(search))
    decoder.compiled_loop = False
    decoder.runner.compiled_attention = False
    decoder.runner.sync_free = sync_free
    samples = samples if samples is not None else batches(task)
    with torch.no_grad(), count_update_syncs(decoder) as records, \
            (watch(decoder, records) if watch else contextlib.nullcontext()):
        cohorts = (decoder.open(s["net_input"], ids=s["id"]) for s in samples)
        if schedule == "stream":
            out = dict(StreamPool(decoder, 8, eps=1 / 6, refill_unit="sentences").run(cohorts))
        elif schedule == "top-up":
            out = dict(StreamPool(decoder, 8, eps=0.5, order="fifo").run(cohorts))
        else:
            out = {}
            for s in samples:
                out.update(zip(s["id"].tolist(), decoder.generate(models, s)))
    plain = {i: [(h["tokens"].tolist(), h["positional_scores"].tolist(), h["score"].item()) for h in hyps]
             for i, hyps in out.items()}
    return plain, records


@pytest.mark.parametrize("name", sorted(DEVICE_SEARCHES))
def test_the_device_paths_quiet_step_reads_once_outside_the_runner_and_decodes_the_same_bits(loaded, monkeypatch,
                                                                                           name):
    from fairseq_stream.ops import attention, beam_step

    monkeypatch.setattr(beam_step, "available", lambda device: False)  # the search step in torch, as on CUDA
    # The attention's two bmm calls, as on CUDA: on the CPU a small group takes torch's fused attention by the
    # rows it attends over, which a slot index kept as a tensor (the identity included) changes.
    monkeypatch.setattr(attention, "_use_sdpa", lambda t, rows: False)
    models, task = loaded("transformer")
    search, schedule = DEVICE_SEARCHES[name]
    out, records = device_path_decode(models, task, search, schedule, sync_free=True)
    reference, _ = device_path_decode(models, task, search, schedule, sync_free=False)
    assert len(out) == 37 and out == reference
    quiet = [r for r in records if r.quiet]
    assert len(quiet) > len(records) / 2, [(r.step, r.finished, r.runner_calls) for r in records][:10]
    assert not [(r.step, r.runner_events) for r in quiet if r.runner_syncs], "the runner read the device"
    extra = [(r.step, r.events) for r in quiet if r.syncs > 1]
    assert not extra, "quiet steps synchronized more than once: {}".format(extra[:3])


# A cohort's search step, as the engine calls it: the output layer (in the model call), the selection, the update.
SEARCH_STEP = ("_candidates", "select", "update")


@contextlib.contextmanager
def watched(decoder, records, around, log, names=("step", "step_mixed", "step_own", "reorder")):
    """Run the runner's ``names`` (and the decoder's search step: ``SEARCH_STEP``) inside ``around()``; ``log``
    receives (the index of the update record the call belongs to, the call's name, what ``around`` yielded)."""
    targets = [(decoder.runner, name) for name in names if hasattr(decoder.runner, name)] + \
        list(zip((decoder, decoder.policy, decoder.books), SEARCH_STEP))
    before = [dict(vars(obj)) for obj, _ in targets]  # the counter's wrappers, put back afterwards

    def wrap(name, method):
        def call(*args, **kwargs):
            index = len(records)
            with around() as seen:
                out = method(*args, **kwargs)
            log.append((index, name, seen))
            return out

        return call

    for obj, name in targets:
        setattr(obj, name, wrap(name, getattr(obj, name)))
    try:
        yield
    finally:
        for (obj, name), saved in zip(targets, before):
            setattr(obj, name, saved[name]) if name in saved else delattr(obj, name)


@contextlib.contextmanager
def cuda_sync_warnings():
    """The messages of synchronizing CUDA calls made inside (``torch.cuda.set_sync_debug_mode("warn")``)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        found = []
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode("default")
            found.extend(str(w.message) for w in caught if "synchroniz" in str(w.message))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["fixed", "var-stream", "greedy"])
def test_the_lean_runner_on_cuda_does_not_synchronize_in_a_quiet_step(loaded, name):
    """On the GPU: the default (sync-free) path gives the reading path's bits, and CUDA's own sync check sees
    no synchronizing call inside the runner on a step where no sentence finishes or enters."""
    from fairseq import utils

    cpu_models, task = loaded("transformer")
    models = [copy.deepcopy(m).cuda() for m in cpu_models]
    samples = [utils.move_to_cuda(s) for s in batches(task)]
    search, schedule = DEVICE_SEARCHES[name]
    log = []
    watch = lambda decoder, records: watched(decoder, records, cuda_sync_warnings, log, names=STEP_METHODS)
    out, records = device_path_decode(models, task, search, schedule, sync_free=None, samples=samples, watch=watch)
    reference, _ = device_path_decode(models, task, search, schedule, sync_free=False, samples=samples)
    assert len(out) == 37 and out == reference
    quiet = {i for i, r in enumerate(records) if r.quiet}
    assert quiet
    synced = [(records[i].step, call, found) for i, call, found in log
              if i in quiet and found and call not in SEARCH_STEP]
    assert not synced, synced[:3]


@pytest.mark.parametrize("name", ["fixed", "var-stream", "greedy"])
def test_the_device_paths_quiet_step_makes_no_aten_call_that_reads_or_shapes_by_values(loaded, monkeypatch, name):
    """Below the torch functions the counter sees: the ATen calls of a quiet step (runner and search update),
    as a CUDA graph capture would record them, hold no read of a value and no output shaped by values."""
    from fairseq_stream.ops import attention, beam_step

    monkeypatch.setattr(beam_step, "available", lambda device: False)
    monkeypatch.setattr(attention, "_use_sdpa", lambda t, rows: False)
    models, task = loaded("transformer")
    search, schedule = DEVICE_SEARCHES[name]
    log = []
    watch = lambda decoder, records: watched(decoder, records, OpTrace, log)
    out, records = device_path_decode(models, task, search, schedule, sync_free=True, watch=watch)
    assert len(out) == 37
    quiet = {i for i, r in enumerate(records) if r.quiet}
    calls = [(i, name, trace) for i, name, trace in log if i in quiet]
    assert calls and all(trace.calls for _, _, trace in calls)
    found = [(records[i].step, name, c.op) for i, name, trace in calls for c in trace.data_dependent()]
    assert not found, found[:5]


def random_order(counts, k, generator):
    """A decoder-like reorder of rows grouped by sentence (``counts``: each sentence's rows): each sentence
    ends (0 rows) or takes 1..k rows whose parents are its own rows (repeats allowed, any order)."""
    order, new, start = [], [], 0
    for n in counts:
        ends = torch.rand((), generator=generator).item() < 0.1
        m = 0 if ends else int(torch.randint(1, k + 1, (), generator=generator))
        order += (start + torch.randint(0, n, (m,), generator=generator)).tolist()
        new.append(m)
        start += n
    return torch.tensor(order, dtype=torch.long), new


def random_walk(runner, samples, sync_free, seed, k=5, steps=16):
    """Two groups started one row a sentence, stepped and reordered at random, one joined to the other at
    another length halfway; every step's log-probabilities (the reorders by host counts where ``sync_free``)."""
    generator = torch.Generator().manual_seed(seed)
    states, counts, outs = [], [], []
    for s in samples:
        states.append(runner.start(s["net_input"], 1))
        counts.append([1] * s["id"].numel())
    for step in range(steps):
        if step == steps // 2:  # the second group joins at its own length (top-up's merge)
            states, counts = [runner.concat(states, any_length=True)], [counts[0] + counts[1]]
        for i, state in enumerate(states if step >= steps // 2 else states[: 1 + step % 2]):
            rows = sum(counts[i])
            if not rows:
                continue
            out, _ = runner.step_own([state], torch.randint(4, 600, (rows, 1), generator=generator))
            outs.append(out)
            order, new = random_order(counts[i], k, generator)
            runner.sync_free = sync_free
            runner.reorder(state, order, sentence_rows=new)
            counts[i] = [n for n in new if n]
    return outs


@pytest.mark.parametrize("seed", range(4))
def test_reorders_by_host_counts_give_the_reading_reorders_bits(loaded, monkeypatch, seed):
    """Random decoder-like reorders (children, ended sentences, grown and compacted caches, two segments at
    different lengths) on the lean runner's torch path: by the host's counts, the same bits as reading."""
    from fairseq_stream.ops import attention
    from fairseq_stream.runners.lean import LeanRunner

    monkeypatch.setattr(attention, "_use_sdpa", lambda t, rows: False)  # as on CUDA (see above)
    models, task = loaded("transformer")
    samples = batches(task, 32)
    runner = LeanRunner(models, compiled_attention=False)
    with torch.no_grad():
        read = random_walk(runner, samples, False, seed)
        with HostSyncCounter() as counter:
            counted = random_walk(runner, samples, True, seed)
    assert len(read) == len(counted) > 12
    assert all(torch.equal(a, b) for a, b in zip(read, counted))
    # (Starting a group encodes its batch, which reads lengths: not a step.)
    step_code = ("runners/lean.py", "ops/packing.py", "ops/attention.py")
    assert not [e for e in counter.events if any(path in e[1] for path in step_code)], counter.events[:5]


@pytest.mark.parametrize("name", ["fixed", "var-stream"])
def test_a_stacked_ensemble_on_the_device_path_reads_once_and_decodes_the_same_bits(loaded, monkeypatch, name):
    """The two-member toy ensemble stacked into one model (as on CUDA by default): its one cache moves by the
    host's counts as a member's does."""
    from fairseq_stream.ops import attention, beam_step

    monkeypatch.setattr(beam_step, "available", lambda device: False)
    monkeypatch.setattr(attention, "_use_sdpa", lambda t, rows: False)
    models, task = loaded("ensemble")
    search, schedule = DEVICE_SEARCHES[name]
    out, records = device_path_decode(models, task, search, schedule, sync_free=True, stack_members=True)
    reference, _ = device_path_decode(models, task, search, schedule, sync_free=False, stack_members=True)
    assert len(out) == 37 and out == reference
    quiet = [r for r in records if r.quiet]
    assert quiet and not [(r.step, r.runner_events) for r in quiet if r.runner_syncs or r.syncs > 1]
