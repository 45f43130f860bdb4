"""CUDA graphs of the static-slot step (runners/step_graphs.py, ``--cuda-graphs``; issue 53, stage 3).

On the CPU: the option's one-line refusals (``on`` without CUDA or without
``--runner static``) and ``auto`` staying eager. Marked ``cuda`` (run by
scripts/gpu_check.sh's cuda-tests step, skipped here): a replayed step
equals the eager static step bitwise through steps and reorders; decodes
with graphs give the eager decodes' n-best lists bitwise (greedy and fixed,
read at once and two calls late); and in steady state (every key captured)
the runner's steps and quiet reorders make no synchronizing CUDA call
(``torch.cuda.set_sync_debug_mode("error")``).
"""

import contextlib
import copy

import pytest
import torch

from conftest import decode, decoder_options, sorted_batches
from fairseq_stream.decoder import BeamDecoder
from fairseq_stream.errors import FairseqStreamError
from fairseq_stream.runners import build_runner
from fairseq_stream.runners.step_graphs import enabled

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CUDA graphs)")


def test_cuda_graphs_option_on_the_cpu(toy, capsys):
    """``auto`` decodes eagerly on the CPU; ``on`` is refused there and off ``--runner static``, in one line."""
    from conftest import generate_in_process, hypotheses

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not enabled("auto", "static", cpu) and not enabled("off", "static", cuda)
    assert enabled("auto", "static", cuda) and not enabled("auto", "lean", cuda)
    with pytest.raises(FairseqStreamError, match="must be one of"):
        enabled("sometimes", "static", cuda)
    argv = [str(toy.data_bin), "--path", str(toy.transformer), "--gen-subset", "test", "--batch-size", "8",
            "--beam", "5", "--cpu", "--user-dir", "fairseq_stream", "--search", "fixed", "--runner", "static"]
    generate_in_process(argv + ["--cuda-graphs", "auto"])
    assert len(hypotheses(capsys.readouterr().out)) == 37
    with pytest.raises(FairseqStreamError, match="needs the models on CUDA"):
        generate_in_process(argv + ["--cuda-graphs", "on"])
    with pytest.raises(FairseqStreamError, match="needs --runner static"):
        generate_in_process([a if a != "static" else "lean" for a in argv] + ["--cuda-graphs", "on"])


class RerunGraph:
    """A stand-in for a captured graph on the CPU: replay runs the step again on the static buffers and writes
    the results into the captured outputs. It checks StepGraphs' bookkeeping (keys, buffers, outputs), not
    CUDA's capture."""

    def __init__(self, forward, buffers, positions, outputs):
        self.forward, self.buffers, self.positions, self.outputs = forward, buffers, positions, outputs

    def replay(self):
        for out, new in zip(self.outputs, self.forward(*self.buffers, self.positions)):
            out.copy_(new)


@pytest.mark.parametrize("lag", [0, 2])
@pytest.mark.parametrize("search", ["greedy", "fixed"])
def test_step_graphs_bookkeeping_on_the_cpu_with_a_rerun_stand_in(loaded, monkeypatch, search, lag):
    """The graph path's inputs, keys and outputs, with replays that rerun the step: the eager decode's bits."""
    from fairseq_stream.runners import step_graphs

    def capture(self, inputs, positions):
        buffers = [t.clone() for t in inputs]
        outputs = self.forward(*buffers, positions)
        self.captures += 1
        return step_graphs._Captured(RerunGraph(self.forward, buffers, positions, outputs), buffers, outputs)

    monkeypatch.setattr(step_graphs.StepGraphs, "_capture", capture)
    models, task = loaded("transformer")
    batches = sorted_batches(task, 8, 24)
    decoders = {graphs: graph_decoder(models, task, search, graphs, lag) for graphs in (False, True)}
    out = {graphs: decode(dec, models, batches, None) for graphs, dec in decoders.items()}
    assert_bitwise(out[False], out[True])
    graphs = decoders[True].runner.graphs
    # Positions reserved at each batch's start: captures per (row bucket, position bucket), not per step.
    assert 0 < graphs.captures < graphs.replays / 4, (graphs.captures, graphs.replays)
    # A batch's first steps run its 8 sentences' k rows each: a bucket of their own (fixed: 40, not 64).
    assert max(key[0] for key in graphs.graphs) == 8 * decoders[True].beam_size


def assert_bitwise(ref, ours):
    assert sorted(ours) == sorted(ref) and len(ours) == 24
    for sid, hyps in ref.items():
        for a, b in zip(hyps, ours[sid]):
            assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["score"], b["score"])
            assert torch.equal(a["positional_scores"], b["positional_scores"])


def cuda_models(loaded, name="transformer"):
    models, task = loaded(name)
    return [copy.deepcopy(m).cuda() for m in models], task


def static_runner(models, graphs: bool):
    """The static runner as a captured step runs it; eager (``graphs`` False) with the same buckets."""
    runner = build_runner("static", models, keep_fairseq=False)
    if graphs:
        runner.use_cuda_graphs()
    else:
        runner.compiled_attention = False
        runner.default_buckets()
    return runner


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("name", ["transformer", "ensemble"])
def test_cuda_graph_replay_equals_the_eager_static_step(loaded, name):
    """Start, then steps and reorders (beams copied across slots, a sentence dropped): the same bits."""
    models, task = cuda_models(loaded, name)
    sample = sorted_batches(task, 6, 1000)[0]
    net_input = {key: value.cuda() for key, value in sample["net_input"].items()}
    eager, graphed = static_runner(models, False), static_runner(models, True)
    k, S = 4, sample["id"].numel()
    states = [r.start(net_input, k) for r in (eager, graphed)]
    tokens = torch.full((S * k, 1), task.target_dictionary.eos(), dtype=torch.long, device="cuda")
    generator = torch.Generator().manual_seed(0)
    for step in range(20):  # past a position bucket: a second capture
        outs = [r.step(s, tokens)[0] for r, s in zip((eager, graphed), states)]
        assert torch.equal(outs[0], outs[1]), step
        rows = tokens.size(0) // k
        keep = rows if step != 3 else rows - 1
        parents = torch.randint(0, k, (keep, k), generator=generator) + torch.arange(keep).unsqueeze(1) * k
        order = parents.sort(dim=1).values.view(-1).cuda()
        counts = [k] * keep + [0] * (rows - keep)
        for r, s in zip((eager, graphed), states):
            r.reorder(s, order, sentence_rows=counts)
        tokens = torch.cat([tokens[order], outs[0][order].argmax(dim=1, keepdim=True)], dim=1)
    assert graphed.graphs.captures >= 2 and graphed.graphs.replays == 20


def graph_decoder(models, task, search, graphs: bool, lag: int):
    opts = dict(decoder_options(search), output_layer="torch" if search == "fixed" else "fused")
    runner = static_runner(models, graphs)
    dec = BeamDecoder(models, task.target_dictionary, runner=runner, keep_reference=False, host_lag=lag, **opts)
    return dec


def cuda_batches(task, size=8, limit=24):
    from fairseq import utils

    return [utils.move_to_cuda(s) for s in sorted_batches(task, size, limit)]


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("lag", [0, 2])
@pytest.mark.parametrize("search", ["greedy", "fixed"])
def test_cuda_graph_decodes_equal_eager_decodes_bitwise(loaded, search, lag):
    models, task = cuda_models(loaded)
    batches = cuda_batches(task)
    out = {graphs: decode(graph_decoder(models, task, search, graphs, lag), models, batches, None)
           for graphs in (False, True)}
    assert_bitwise(out[False], out[True])


@contextlib.contextmanager
def sync_errors():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("search", ["greedy", "fixed"])
def test_cuda_graph_steady_state_makes_no_synchronizing_call(loaded, search):
    """A third decode of the same batches replays graphs captured before: its steps and quiet reorders (no
    sentence leaving) run under ``set_sync_debug_mode("error")``; the search reads two calls late."""
    models, task = cuda_models(loaded)
    batches = cuda_batches(task)
    dec = graph_decoder(models, task, search, True, 2)
    for _ in range(2):  # the first decode grows the pool to its size, the second captures what that changed
        decode(dec, models, batches, None)
    runner, captured = dec.runner, dec.runner.graphs.captures
    step, reorder, guarded = runner.step, runner.reorder, []

    def guarded_step(*args, **kwargs):
        guarded.append("step")
        with sync_errors():
            return step(*args, **kwargs)

    def guarded_reorder(state, order, sentence_rows=None):
        if sentence_rows is None or 0 in sentence_rows:
            return reorder(state, order, sentence_rows)  # a sentence leaves: slots go back (a host list)
        guarded.append("reorder")
        with sync_errors():
            return reorder(state, order, sentence_rows)

    runner.step, runner.reorder = guarded_step, guarded_reorder
    try:
        assert len(decode(dec, models, batches, None)) == 24
    finally:
        del runner.step, runner.reorder
    assert runner.graphs.captures == captured and "step" in guarded
    assert search == "greedy" or "reorder" in guarded
