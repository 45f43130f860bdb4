"""``y = x W^T + b`` with the weight packed once for MKL's sgemm, for the decoder step's skinny products.

``F.linear`` on the CPU calls MKL's sgemm, which copies ``W`` into its
internal blocked layout on every call. A decoder step multiplies few rows (5
to 100) by wide weights, so that copy is a large part of each product. MKL's
packed API (``cblas_sgemm_pack`` once, ``cblas_sgemm_compute`` per call;
``csrc/cpu/prepacked_linear_cpu.cpp``) skips it: on one Xeon thread, with
the Multi30k transformer's shapes, 1.3-2.6x faster at 5-64 rows, the same
from a few hundred rows on (docs/BENCHMARKS.md).

At 1 to 5 rows (one sentence's greedy step, its beam of 5, its Jacobi
window) the product is bound by reading W, and MKL changes method at 4 rows
(0.40 ms against 0.31 at 1 to 3 rows on the Multi30k output layer). There
the product is our own (``csrc/cpu/skinny_linear_cpu.cpp``,
:func:`skinny_rows`): W read once in its own layout while up to 4 rows
share each load, 0.29-0.35 ms at 1 to 5 rows; a whole batch-1 window call
of 1 to 5 positions costs 0.78-0.96 ms against MKL's 0.87-1.11 (one thread
of the Xeon, 2026-11-25; docs/HISTORY.md, "the skinny product"). Its AVX2
tiles (``csrc/cpu/skinny_linear_avx2_cpu.cpp``, for AVX2-only CPUs) take
0.34-0.36 ms at 1 to 5 rows where MKL's AVX2 code takes 0.35 at 1 row,
0.54-0.55 at 2 and 3 (unpacked) and 0.62-0.69 at 4 and 5 (packed; the
Xeon capped to AVX2, 2026-11-27). Without AVX2 and FMA, 2 and 3 rows take
MKL's unpacked skinny path (``F.linear`` on the weight itself) and the
other row counts the packed product.

:func:`linear` returns a callable ``f(x)`` for a weight and bias: the
prepacked product where it applies (a float32 CPU weight, the compiled
module built, MKL found in torch), else ``F.linear`` on the weight. So
float64 (the exactness tests' type), CUDA and a torch without MKL keep
torch's arithmetic.

**Arithmetic.** The same float32 products summed in another order than
``F.linear``'s: results agree to float32 rounding (bitwise at some row
counts, not at others), as products of two sgemm calls of different shapes
do (tests/test_prepacked_linear.py bounds the difference against float64).
At the skinny row counts each row's results are the same bits whatever
rows share the call. The packed copy holds the weight as it was when
packed; products of 1 to 5 rows (2 and 3 without AVX2) read the
parameter itself. Change a parameter after packing and the two disagree:
pack again (a new runner).
"""

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from fairseq_stream.ops.loader import compiled_module

Linear = Callable[[Tensor], Tensor]


def missing_reason() -> str:
    """Why the prepacked product cannot run in this process ("" where it can)."""
    module = compiled_module("cpu")
    if module is None or not hasattr(module, "PrepackedLinear"):
        return "the compiled CPU extension is not built"
    return module.prepacked_linear_missing()


def skinny_rows() -> int:
    """Up to how many rows the product reads the weight once in its own layout (0 where the CPU lacks AVX2 and FMA).

    At those row counts each row's results are the same bits whatever rows
    share the call (``csrc/cpu/skinny_linear_cpu.cpp``).
    """
    module = compiled_module("cpu")
    return module.skinny_linear_rows() if module is not None and hasattr(module, "skinny_linear_rows") else 0


def skinny_kernel() -> str:
    """The skinny product's tiles in this process: ``avx512``, ``avx2`` (also under ATEN_CPU_CAPABILITY=avx2), or ""."""
    module = compiled_module("cpu")
    return module.skinny_linear_kernel() if module is not None and hasattr(module, "skinny_linear_kernel") else ""


def available() -> bool:
    """Whether :func:`linear` can prepack float32 CPU weights here."""
    return missing_reason() == ""


class TorchLinear:
    """``F.linear(x, weight, bias)`` as a callable: what :func:`linear` gives where it cannot prepack."""

    def __init__(self, weight: Tensor, bias: Optional[Tensor]):
        self.weight, self.bias = weight, bias

    def __call__(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


def linear(weight: Tensor, bias: Optional[Tensor] = None, prepack: bool = True) -> Linear:
    """A callable computing ``x W^T + b``: prepacked for MKL where it applies (and ``prepack``), else torch's.

    Args:
        weight: (out, in).
        bias: (out,) or None.
        prepack: False to keep ``F.linear`` everywhere (the reference arithmetic).
    """
    if prepack and weight.dtype == torch.float32 and weight.device.type == "cpu" and available():
        # Packing reads the values only: no autograd graph follows the copy.
        return compiled_module("cpu").PrepackedLinear(weight.detach(), bias.detach() if bias is not None else None)
    return TorchLinear(weight, bias)
