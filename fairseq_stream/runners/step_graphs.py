"""CUDA graphs of the static-slot step (``--cuda-graphs``; issue 53, stage 3): capture once, replay each step.

A step of the static-slot runner launches a kernel per operation (about a
hundred for a small transformer, a thousand for a WMT'19 ensemble), and on a
GPU the host's launches, not the device, bound it. The runner's
:meth:`~fairseq_stream.runners.static_slots.StaticSlotRunner.forward_static`
has fixed shapes for a given (rows, positions, pool shape) once rows are
padded to a bucket and key positions to a multiple of the length bucket, and
reads nothing back (tests/test_static_graph_trace.py). :class:`StepGraphs`
captures it per such key with ``torch.cuda.CUDAGraph`` on the step's
inputs copied into static buffers, and replays it: one launch a step. Keys
and values are written into the pool in place by the graph, as by the eager
step; the pool must not move, so a pool that grows (another shape) or is
rebuilt drops the graphs it had and captures again; a decode sizes the pool at
its start (``StaticSlotRunner.reserve_positions`` and, for the dense searches,
``StaticSlotRunner.reserve`` from what the scheduler holds), so that only a
longer source than the first batch's can grow it (docs/GPU.md).

Before a capture the step runs eagerly on a side stream (``WARMUP_RUNS``:
cuBLAS and the allocator set up there what the graph then uses); those runs
write the same keys and values as the step itself, so they change nothing.
The graphs share one memory pool (``torch.cuda.graph_pool_handle``, as
vLLM's captures per batch size do), which is safe here because a later
capture reuses only what earlier ones freed at their end, their
intermediates, which nothing reads between replays (graphs replay one at a
time, on one stream); each graph's outputs stay allocated with it and are
cloned right after each replay all the same. Memory is then the largest
graph's working set, not the sum over every (rows, positions) key: with a
pool per graph, fixed k=5 in graphs peaked at 83 GB on the 4-member
WMT-sized stand-in (H200, docs/GPU.md), the lean runner at 10 GB. The
capture watches this thread only: the stream pool's read-ahead thread may
encode on its own stream meanwhile.

Exactness: a replay launches the kernels the eager step launched, on the
same inputs; tests marked ``cuda`` check it bitwise and that steady-state
steps make no synchronizing CUDA call. They passed twice on an H200 with a
pool per graph; the shared pool is for the next lent GPU to check
(docs/GPU.md).
"""

from typing import Callable, Dict, List

import torch
from torch import Tensor

from fairseq_stream.errors import FairseqStreamError

MODES = ("on", "off", "auto")
# Eager runs on a side stream before a capture (PyTorch's recipe for torch.cuda.graph).
WARMUP_RUNS = 2
# The buckets a captured step uses where --static-buckets gives none: a graph per bucket, not per row count
# or length.
DEFAULT_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
DEFAULT_LENGTH_BUCKET = 16


def enabled(mode: str, runner_name, device) -> bool:
    """Whether ``--cuda-graphs mode`` captures the step: ``off`` never, ``auto`` with ``--runner static`` on
    CUDA, ``on`` there too and a one-line error elsewhere."""
    if mode not in MODES:
        raise FairseqStreamError("--cuda-graphs must be one of {}, got {}".format(", ".join(MODES), mode))
    if mode == "off":
        return False
    if mode == "on" and runner_name != "static":
        raise FairseqStreamError("--cuda-graphs on needs --runner static (got --runner {})".format(runner_name))
    if mode == "on" and device.type != "cuda":
        raise FairseqStreamError("--cuda-graphs on needs the models on CUDA (they are on {})".format(device.type))
    return runner_name == "static" and device.type == "cuda"


class _Captured:
    """One captured step: the graph, the static buffers it reads its inputs from, the outputs it writes."""

    def __init__(self, graph, inputs: List[Tensor], outputs: List[Tensor]):
        self.graph, self.inputs, self.outputs = graph, inputs, outputs


class StepGraphs:
    """``forward`` (``forward_static``: tokens, slot, sentence, length, positions -> each model's logits)
    captured per (rows, positions, pool shape) and replayed; see the module docstring."""

    def __init__(self, forward: Callable[..., List[Tensor]]):
        self.forward = forward
        self.graphs: Dict[tuple, _Captured] = {}
        self.pool = None  # the pool the graphs write into (held: a rebuilt pool must not pass for it)
        self.memory = None  # the graphs' one memory pool (a graph_pool_handle), made at the first capture
        self.captures = 0
        self.replays = 0

    def run(self, tokens: Tensor, slot: Tensor, sentence: Tensor, length: Tensor, positions: int,
            pool) -> List[Tensor]:
        """The step's outputs by replaying its graph (captured first where this key is new)."""
        if pool is not self.pool:
            self.graphs.clear()
            self.pool = pool
        key = (tokens.numel(), positions, pool.shape)
        captured = self.graphs.get(key)
        if captured is None:
            # Graphs of another pool shape hold tensors the pool has replaced: never replayed again.
            self.graphs = {k: g for k, g in self.graphs.items() if k[2] == pool.shape}
            captured = self.graphs[key] = self._capture((tokens, slot, sentence, length), positions)
        for buffer, value in zip(captured.inputs, (tokens, slot, sentence, length)):
            buffer.copy_(value, non_blocking=True)
        captured.graph.replay()
        self.replays += 1
        return [out.clone() for out in captured.outputs]

    def _capture(self, inputs, positions: int) -> _Captured:
        device = inputs[0].device
        buffers = [t.clone() for t in inputs]
        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device=device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                self.forward(*buffers, positions)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self.memory is None:
            self.memory = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.memory, capture_error_mode="thread_local"):
            outputs = self.forward(*buffers, positions)
        self.captures += 1
        return _Captured(graph, buffers, outputs)
