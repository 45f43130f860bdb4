"""``y = x W^T + b`` with the weight packed once for MKL's sgemm, for the decoder step's skinny products.

``F.linear`` on the CPU calls MKL's sgemm, which copies ``W`` into its
internal blocked layout on every call. A decoder step multiplies few rows (5
to 100) by wide weights, so that copy is a large part of each product. MKL's
packed API (``cblas_sgemm_pack`` once, ``cblas_sgemm_compute`` per call;
``csrc/cpu/prepacked_linear_cpu.cpp``) skips it: on one Xeon thread, with
the Multi30k transformer's shapes, 1.3-2.6x faster at 5-64 rows, the same
from a few hundred rows on (docs/BENCHMARKS.md). At 2 and 3 rows MKL's
unpacked sgemm takes a skinny path, 18% faster than the packed product on
the Multi30k output layer (from 4 rows on it is up to twice as slow), so
there the callable is
``F.linear`` on the weight itself; Jacobi's windows at batch 1 are such
products (docs/BENCHMARKS.md, Jacobi run 5).

:func:`linear` returns a callable ``f(x)`` for a weight and bias: the
prepacked product where it applies (a float32 CPU weight, the compiled
module built, MKL found in torch), else ``F.linear`` on the weight. So
float64 (the exactness tests' type), CUDA and a torch without MKL keep
torch's arithmetic.

**Arithmetic.** The same float32 products summed by MKL in another blocking
than ``F.linear``'s: results agree to float32 rounding (bitwise at some
row counts, not at others), as products of two sgemm calls of different
shapes do (tests/test_prepacked_linear.py bounds the difference against
float64). The packed copy holds the weight as it was when packed; products
of 2 and 3 rows read the parameter itself. Change a parameter after packing
and the two disagree: pack again (a new runner).
"""

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from fairseq_stream.ops.output_layer import compiled_module

Linear = Callable[[Tensor], Tensor]


def missing_reason() -> str:
    """Why the prepacked product cannot run in this process ("" where it can)."""
    module = compiled_module("cpu")
    if module is None or not hasattr(module, "PrepackedLinear"):
        return "the compiled CPU extension is not built"
    return module.prepacked_linear_missing()


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
