"""What a decoder step asks of a GPU, counted on the CPU: its kernels, arithmetic and memory traffic by kind.

The lean runner's CUDA code path (the torch attention, the bmm form CUDA
takes; members stacked as CUDA stacks them by default) runs here on the CPU,
on random members of a shape (``wmt19``: the transformer-big of the WMT'19
systems, 6+6 layers, 1024 dims, FFN 8192, 42,024 words; ``m30k``), and
every ATen call of ``--steps`` decoder calls from call ``--first`` on is
recorded below autograd (a ``TorchDispatchMode``, the calls a CUDA graph
would capture): whether it launches a kernel (views and allocations do
not), its floating-point operations (torch.utils.flop_counter's formulas)
and the bytes it reads and writes, floating tensors counted at
``--element-bytes`` (2: fp16, as gpu_bench decodes). Per kind (the names of
benchmarks/gpu_kernels.py) it prints kernels, GFLOP and GB per call and a
roofline estimate of the device time: each kernel ``max(flops / peak,
bytes / bandwidth, floor)`` at ``--peak-tflops``, ``--bandwidth-tbs`` and
``--floor-us`` (defaults: an H200's fp16 tensor peak and HBM3e bandwidth
at about 70% and 80%, 2 us for a launch's smallest kernel: assumptions, not
measurements). The search step's compiled op and the fused output layer are
outside ATen on the CPU; the output layer is counted as one read of the
logits (its one pass on CUDA), the search step (4 small launches on CUDA)
not at all. The beam's slot copies are counted as CUDA's kernel
(``copy_cache_slots_``: each copied position read and written once) for
``lean`` and ``static-indexed``; ``static`` keeps torch's indexed copy to the
position bucket (the step as the first GPU runs captured it).

gpu_bench's ``kernels`` step measures the same on a lent GPU: the two tables
side by side say which kernels run below their roofline.

    python benchmarks/device_work.py --shape wmt19 --members 4 --sentences 64 --beam 5 --first 8 --steps 2
"""

import preamble  # first: the import paths, then the threads before torch starts its pools

import argparse  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402
from torch.utils.flop_counter import flop_registry  # noqa: E402

import gpu_kernels  # noqa: E402
from bench_ensemble import members, sources  # noqa: E402

from fairseq_stream.decoder import BeamDecoder  # noqa: E402
from fairseq_stream.ops import attention, indexed_attention  # noqa: E402
from fairseq_stream.runners.lean import LeanRunner  # noqa: E402
from fairseq_stream.runners.static_slots import StaticSlotRunner  # noqa: E402

# ATen calls that launch no kernel beyond their views' metadata (and allocations, which are the allocator's).
NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "detach",
             "alias", "_local_scalar_dense", "is_nonzero", "sym_size", "sym_stride", "sym_numel"}


def launches(func) -> bool:
    """Whether an ATen call runs a kernel: not an allocation, not a view (every output an unwritten alias)."""
    if func.__name__.split(".")[0] in NO_KERNEL:
        return False
    returns = func._schema.returns
    return not (returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns))


# Reads and writes of the selected elements only, not of the whole source or destination (a cache).
GATHERS = {"index_select", "index", "gather", "take", "embedding"}  # traffic: the output's, twice
SCATTERS = {"index_put_", "index_put", "index_copy_", "index_copy", "index_add_", "scatter_", "scatter",
            "scatter_add_", "masked_scatter_", "put_"}  # traffic: the values written, twice


def tensors(value):
    """The tensors among ``value``'s leaves (arguments, keyword arguments, results)."""
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


class WorkTrace(TorchDispatchMode):
    """Each kernel-launching ATen call while ``recording``: (name, flops, bytes, output shapes)."""

    def __init__(self, element_bytes: int):
        super().__init__()
        self.element_bytes, self.recording, self.calls = element_bytes, False, []

    def nbytes(self, t: torch.Tensor) -> int:
        return t.numel() * (self.element_bytes if t.is_floating_point() else t.element_size())

    def traffic(self, name, args, kwargs, out):
        """Bytes a kernel reads and writes: every input and output, but a gather's and a scatter's own
        elements only (twice: read and written) and their indices."""
        indices = sum(self.nbytes(t) for t in tensors((args, kwargs)) if not t.is_floating_point())
        if name in GATHERS:
            return 2 * sum(self.nbytes(t) for t in tensors(out)) + indices
        if name in SCATTERS:
            # The source values: every floating input but the destination (the first argument).
            values = sum(self.nbytes(t) for t in tensors((args[1:], kwargs)) if t.is_floating_point())
            return 2 * values + indices
        return sum(self.nbytes(t) for t in tensors((args, kwargs))) + sum(self.nbytes(t) for t in tensors(out))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.recording and launches(func):
            counter = flop_registry.get(func._overloadpacket)
            flops = counter(*args, **kwargs, out_val=out) if counter else 0
            moved = self.traffic(func.__name__.split(".")[0], args, kwargs, out)
            shapes = [tuple(t.shape) for t in tensors(out)]
            self.calls.append(("aten::" + func.__name__.split(".")[0], int(flops), moved, shapes))
        return out


def estimate_us(flops, moved, args):
    return max(flops / (args.peak_tflops * 1e6), moved / (args.bandwidth_tbs * 1e6), args.floor_us)


def summarize(calls, steps, vocab, args):
    """Per kind: kernels, GFLOP, GB and roofline ms per call; plus the output layer's read of the logits."""
    kinds = collections.OrderedDict()
    for name, flops, moved, _ in calls:
        k = kinds.setdefault(gpu_kernels.kind_of(name), dict(kernels=0, flops=0, bytes=0, us=0.0))
        k["kernels"] += 1
        k["flops"] += flops
        k["bytes"] += moved
        k["us"] += estimate_us(flops, moved, args)
    logits = sum(args.element_bytes * torch.Size(s).numel() for name, _, _, shapes in calls
                 if gpu_kernels.kind_of(name) == "products" for s in shapes if s and s[-1] == vocab)
    read_us = steps * args.floor_us + logits / (args.bandwidth_tbs * 1e6)
    kinds["output layer (one read of the logits)"] = dict(kernels=steps, flops=0, bytes=logits, us=read_us)
    rows = []
    for kind, k in kinds.items():
        rows.append(dict(kind=kind, kernels_per_call=k["kernels"] / steps, gflop_per_call=k["flops"] / steps / 1e9,
                         gb_per_call=k["bytes"] / steps / 1e9, est_ms_per_call=k["us"] / steps / 1e3))
    rows.sort(key=lambda r: -r["est_ms_per_call"])
    top = collections.Counter()
    for name, flops, moved, _ in calls:
        top[name] += estimate_us(flops, moved, args) / steps / 1e3
    return rows, top.most_common(10)


def as_indexed_kernel(trace: WorkTrace):
    """Count the static step's attentions as CUDA runs them, one indexed_attention kernel each
    (fairseq_stream/ops/indexed_attention.py), where the CPU runs the torch form: its answer is the reference's,
    computed unrecorded; its cost one kernel reading the query, the visible keys and values once, and writing
    the output."""
    def kernel(q, keys, values, index, mask=None, lengths=None, scale=1.0):
        recording, trace.recording = trace.recording, False
        out = indexed_attention.reference(q, keys, values, index, mask, lengths, scale)
        rows, (_, heads, T, hd) = q.size(0), keys.shape
        visible = T * rows if lengths is None else int(lengths.clamp(max=T - 1).add(1).sum())
        trace.recording = recording
        if recording:
            flops = 4 * heads * hd * visible  # q.k and the weighted sum of values
            moved = 2 * trace.nbytes(q) + 2 * heads * hd * visible * trace.element_bytes + 8 * rows
            trace.calls.append(("fairseq_stream::indexed_attention", flops, moved, [tuple(out.shape)]))
        return out

    indexed_attention.available = lambda q, keys: True
    indexed_attention.indexed_attention = kernel


def as_copy_kernel(trace: WorkTrace):
    """Count the beam's slot copies as CUDA runs them, one copy_cache_slots_ kernel a cache
    (csrc/cuda/cache_slots_cuda.cu), where the CPU runs torch's indexed copy: the copy itself unrecorded; its
    cost each non-padded entry's positions read and written once, and the indices."""
    def kernel(cache, source, target, length):
        recording, trace.recording = trace.recording, False
        attention.indexed_copy_slots_(cache, source, target, length)
        copied = int(source.ne(target).sum())  # the count's own ops unrecorded too
        trace.recording = recording
        if recording and source.numel():
            outer, _, heads, _, hd = cache.shape
            moved = 2 * copied * outer * heads * int(length) * hd * trace.element_bytes + 16 * source.numel()
            trace.calls.append(("fairseq_stream::copy_cache_slots_", 0, moved, []))

    attention.copy_slots_ = kernel
    StaticSlotRunner._copies_in_place = lambda self: True


def run(args):
    # The CUDA code path on the CPU: the bmm attention (CUDA never takes SDPA, attention._use_sdpa), the torch
    # forms of the compiled attention kernels.
    attention._use_sdpa = lambda t, rows: False
    models, d = members(args.shape, args.members)
    batch = sources(d, args.sentences, args.sentences)[0]
    length = args.first + args.steps + 1
    # prepack=False: the products as torch calls (batched for stacked members), as on CUDA; the compiled
    # step and attention off for their torch forms.
    if args.runner in ("static", "static-indexed"):
        # As --cuda-graphs captures it: the torch attention, rows and positions in the default buckets.
        runner = StaticSlotRunner(models, prepack=False, compiled_attention=False, stack_members=args.stack == "on")
        runner.default_buckets()
    else:
        runner = LeanRunner(models, prepack=False, compiled_attention=False, compiled_step=False,
                            stack_members=args.stack == "on")
        runner.sync_free = True  # CUDA's reorder: by the host's row counts, no read of the device
    dec = BeamDecoder(models, d, runner=runner, output_layer="auto", keep_reference=False, beam_size=args.beam,
                      finalize="fairseq", max_len_a=0, max_len_b=length, min_len=length)
    dec.compiled_loop = False
    trace, calls = WorkTrace(args.element_bytes), [0]
    if args.runner in ("lean", "static-indexed"):
        as_copy_kernel(trace)
    if args.runner == "static-indexed":
        as_indexed_kernel(trace)
    forward = dec.runner._forward

    def counted(segments, last_tokens, logits=False):
        trace.recording = args.first <= calls[0] < args.first + args.steps
        calls[0] += 1
        return forward(segments, last_tokens, logits)

    dec.runner._forward = counted
    with torch.no_grad(), trace:
        dec.generate(models, batch)
    trace.recording = False
    rows, top = summarize(trace.calls, args.steps, len(d), args)
    return dict(runner=args.runner, shape=args.shape, members=args.members, stacked=dec.runner.stacked is not None,
                sentences=args.sentences, beam=args.beam, rows=args.sentences * args.beam, first=args.first,
                steps=args.steps, element_bytes=args.element_bytes, peak_tflops=args.peak_tflops,
                bandwidth_tbs=args.bandwidth_tbs, floor_us=args.floor_us, host=platform.node(),
                torch=torch.__version__, kinds=rows, costliest=[dict(op=n, est_ms_per_call=v) for n, v in top])


def render(result):
    lines = ["{runner} runner, {shape}, {members} member(s){s}, {sentences} sentences x k={beam} = {rows} rows, "
             "calls {first} to {last}; floats at {element_bytes} bytes; roofline: {peak_tflops} TFLOPS, "
             "{bandwidth_tbs} TB/s, {floor_us} us a kernel at least".format(s=" stacked" if result["stacked"] else "",
                                                      last=result["first"] + result["steps"], **result), "",
             "| kind | kernels/call | GFLOP/call | GB/call | estimated ms/call |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for r in result["kinds"]:
        lines.append("| {kind} | {kernels_per_call:.0f} | {gflop_per_call:.2f} | {gb_per_call:.3f} | "
                     "{est_ms_per_call:.3f} |".format(**r))
    total = sum(r["est_ms_per_call"] for r in result["kinds"])
    lines += ["| all | {:.0f} | {:.2f} | {:.3f} | {:.3f} |".format(
        sum(r["kernels_per_call"] for r in result["kinds"]), sum(r["gflop_per_call"] for r in result["kinds"]),
        sum(r["gb_per_call"] for r in result["kinds"]), total), "", "Costliest ATen ops (estimated ms/call): " +
        ", ".join("{} {:.3f}".format(c["op"], c["est_ms_per_call"]) for c in result["costliest"])]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=["m30k", "wmt19"], default="wmt19")
    p.add_argument("--members", type=int, default=4)
    p.add_argument("--stack", choices=["on", "off"], default="on", help="stacked members (CUDA's default) or not")
    p.add_argument("--runner", choices=["lean", "static", "static-indexed"], default="lean",
                   help="the lean runner, or the static-slot step as --cuda-graphs captures it: with the torch "
                        "forms' gathers and copies (static) or the indexed attention and slot copy kernels CUDA "
                        "runs now (static-indexed)")
    p.add_argument("--sentences", type=int, default=64)
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--first", type=int, default=8, help="the first decoder call recorded (default 8)")
    p.add_argument("--steps", type=int, default=2, help="decoder calls recorded (default 2)")
    p.add_argument("--element-bytes", type=int, default=2, help="bytes a float counts (2: fp16; 4: float32)")
    p.add_argument("--peak-tflops", type=float, default=700.0)
    p.add_argument("--bandwidth-tbs", type=float, default=3.8)
    p.add_argument("--floor-us", type=float, default=2.0)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    result = run(args)
    print(render(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
