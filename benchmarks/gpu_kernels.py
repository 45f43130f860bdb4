"""Where a decode's device time goes: torch.profiler over a window of decoder calls, kernels by kind.

gpu_probe.py opens a :class:`KernelWindow` in a run's untimed warm-up decode
(the profiler's own cost stays out of the measured one): it starts the
profiler at decoder call ``first`` and stops it ``calls`` calls later, after a
synchronize, so the window holds whole steps of a steady state (batch starts
and the encoder only where they fall inside it). :func:`summarize` then
totals the kernels' device time per call, by kind (:data:`KINDS`), and lists
the costliest kernels. Kernels replayed from a CUDA graph are reported like
launched ones (CUPTI records each graph node's kernel).

On the CPU (CI's dry runs) the same window records the ATen operators' own
CPU time instead, and says so (``"clock": "cpu"``): the summary's shape is
the same, its figures are the host's.
"""

import re

import torch

# First match wins; the names are CUDA kernels' (cuBLAS's nvjet/xmma/cutlass, ATen's) and, on the CPU, ATen's
# operators. Our own CUDA kernels live in namespace fairseq_stream.
KINDS = [
    ("ours", re.compile(r"fairseq_stream", re.I)),
    ("softmax/attention", re.compile(r"fmha|flash|attention|sdpa|softmax", re.I)),
    ("products", re.compile(r"gemm|gemv|nvjet|xmma|cutlass|cublas|matmul|aten::(?:b?addb?mm|b?mm|addmv|mv|linear)\b",
                            re.I)),
    ("top-k", re.compile(r"topk|radix|sort", re.I)),
    ("moves", re.compile(r"copy|index|gather|scatter|cat|memcpy|memset|fill|take|put", re.I)),
    ("reductions", re.compile(r"reduce|layer_norm|rms_norm|sum|argmax|argmin|amax|amin|max_|min_", re.I)),
]
OTHER = "elementwise and other"
TOP = 12


def kind_of(name):
    """The kind (:data:`KINDS`) a kernel or operator name falls under."""
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return OTHER


class KernelWindow:
    """torch.profiler over decoder calls ``first`` .. ``first + calls`` of one decode.

    :meth:`on_call` is called with each call's counting point and index
    (gpu_probe's CallLog: our searches' steps, fairseq's forward_decoder; both
    tick once a call where both run, and the window keeps to the one that
    reached ``first`` first). :attr:`summary` holds :func:`summarize`'s dict
    once the window closed (None while it has not: a decode of fewer calls
    leaves it None).
    """

    def __init__(self, first, calls, cuda):
        self.first, self.calls, self.cuda = first, calls, cuda
        self.profiler, self.summary, self.source = None, None, None

    def on_call(self, source, index):
        if index == self.first and self.source is None:
            self.source = source
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                torch.cuda.synchronize()
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.start()
        elif source == self.source and index == self.first + self.calls and self.profiler is not None:
            if self.cuda:
                torch.cuda.synchronize()
            self.profiler.stop()
            self.summary = summarize(self.profiler.key_averages(), self.calls, self.cuda)
            self.summary["first_call"] = self.first
            self.profiler = None

    def close(self):
        """Stop a window the decode did not reach the end of (its summary stays None)."""
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None


def _device_us(event):
    # torch 2.x names it device time (cuda_time in older releases).
    return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0) or 0


def summarize(events, calls, cuda):
    """{clock, calls, ms_per_call, launches_per_call, by_kind: {kind: ms per call}, top: [...]} of
    ``events`` (a profiler's key_averages) over ``calls`` decoder calls: the kernels' device time on
    CUDA, the operators' own CPU time on the CPU."""
    rows = []
    for e in events:
        if cuda:
            us = _device_us(e)
            # Kernels only: an operator's device total repeats its kernels'.
            if not us or str(getattr(e, "device_type", "")).split(".")[-1] != "CUDA":
                continue
        else:
            us = e.self_cpu_time_total
            if not us or not e.key.startswith("aten::"):
                continue
        rows.append((e.key, us, e.count))
    total = sum(us for _, us, _ in rows)
    by_kind = {}
    for name, us, _ in rows:
        kind = kind_of(name)
        by_kind[kind] = by_kind.get(kind, 0.0) + us
    per_call = max(calls, 1)
    top = sorted(rows, key=lambda r: -r[1])[:TOP]
    return {
        "clock": "device" if cuda else "cpu",
        "calls": calls,
        "ms_per_call": round(total / 1000 / per_call, 4),
        "launches_per_call": round(sum(c for _, _, c in rows) / per_call, 1),
        "by_kind": {k: round(v / 1000 / per_call, 4) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "top": [{"name": name[:160], "kind": kind_of(name), "ms_per_call": round(us / 1000 / per_call, 4),
                 "per_call": round(count / per_call, 2)} for name, us, count in top],
    }
