"""The one product op, ``y = x W^T + b``, with its precision a parameter: made here from a weight, a bias and a precision.

:func:`linear` is the only place a product is made, for every caller (the
lean runner's layers and encoder, the LSTM runner, the stacked ensemble,
benchmarks); it returns the compiled ``Product`` (``csrc/cpu/product_cpu.h``,
one bound type for every precision, as in CTranslate2's ``ops/gemm.cc``)
where the precision runs compiled, else :class:`TorchLinear`. Python calls
the product directly, and every compiled step (``ops/lean_step.py``,
``ops/search_loop.py``, ``ops/rnn_step.py``) takes the same object
(:func:`compiled`), so no call pays a Python dispatch. Precisions:

* ``"float32"``: the weight packed once for MKL's sgemm or oneDNN's
  (:func:`float32_gemm`), with our own skinny product at few rows (below);
  where it cannot apply (not a float32 CPU weight, the extension not built,
  MKL not found in torch) torch's ``F.linear`` on the weight
  (:class:`TorchLinear`): float64 (the exactness tests' type), CUDA and a
  torch without MKL keep torch's arithmetic.
* ``"plain"``: ``F.linear`` on the weight as it is (``prepack=False``, the
  reference arithmetic); for a compiled step, ``at::linear``.
* ``"int8"``, ``"int8w8"``, ``"int8w7"``, ``"int16"``: the weight quantized
  once (:mod:`fairseq_stream.ops.quantized_linear` holds the int8 format and
  its scale rule, :mod:`fairseq_stream.ops.int16_linear` int16's), each call
  quantizing its rows; the kernel is the best this CPU runs (the instruction
  set chosen at run time) or the one named.

**The float32 product.** ``F.linear`` on the CPU calls MKL's sgemm, which
copies ``W`` into its internal blocked layout on every call. A decoder step
multiplies few rows (5 to 100) by wide weights, so that copy is a large part
of each product. MKL's packed API (``cblas_sgemm_pack`` once,
``cblas_sgemm_compute`` per call; ``csrc/cpu/prepacked_linear_cpu.cpp``)
skips it: on one Xeon thread, with the Multi30k transformer's shapes,
1.3-2.6x faster at 5-64 rows, the same from a few hundred rows on
(docs/BENCHMARKS.md).

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

**MKL or oneDNN.** MKL runs its tuned code on Intel's CPUs only; on an
AMD CPU it runs its generic code (on the AVX2 EPYC: ``mkl_blas_def_*``
kernels, a copy of the rows on every call). There CTranslate2 takes
oneDNN's GEMM, and so does this product, for weights of at least
:data:`ONEDNN_FROM_WEIGHTS` values: oneDNN's call costs some 40 us more,
which a small weight's product does not win back (one core of the AVX2
EPYC, 2026-12-02: the Multi30k output layer, 8008 x 256, 5.7 against 7.4
ms at 64 rows and 22.6 against 33.6 at 320; its 256 x 256 products 0.20
against 0.15 ms at 64 rows; ``docs/bench/products_epyc_m30k_onednn.json``).
``FAIRSEQ_STREAM_FLOAT32_GEMM=mkl`` or ``onednn`` takes one for every
weight. oneDNN's weight is its own blocked copy in place of MKL's packed
one; its rows go in the same blocks of 64 as MKL's, so threads change no
bits either.

**Panels, so that a second thread has work at few rows.** The GEMM takes
rows in fixed blocks of 64 (below), and our threads share the blocks: a
call of up to 64 rows (a beam of up to 12 sentences, a greedy batch of 64,
a var-stream pool of a few sentences) was one block, on one thread. A
weight of 4M values and up (every WMT'19 feed-forward product and its
output layer; none of the Multi30k model's) is therefore packed in up to 8
panels of output columns, each packed on its own, and a call's (block,
panel) pairs are shared among the threads. The panels are fixed by the
weight's shape, never by the threads, so the threads change no bits; on
the Zen 4 EPYC every panel product gave the whole product's bits. There a
panelled product ran 2.0x as fast on two threads as on one at 8 to 100
rows; on one thread a step's panelled products cost 2-13% more than whole
ones (oneDNN's calls; MKL's 0-8% less), and a 1024 x 1024 weight in two
panels 3-14% more:
weights below 4M values stay whole (``csrc/cpu/prepacked_linear_cpu.cpp``,
``float32_panels``; docs/threads.md). ``FAIRSEQ_STREAM_FLOAT32_PANELS``,
read when a weight is packed: ``off`` keeps every weight whole; ``all``
splits every weight of 128 output columns or more, so that a small model's
decode takes the path a WMT'19 model's big weights take (the tests use it).

Its arithmetic: the same float32 products summed in another order than
``F.linear``'s: results agree to float32 rounding (bitwise at some row
counts, not at others), as products of two sgemm calls of different shapes
do (tests/test_prepacked_linear.py bounds the difference against float64).
At the skinny row counts each row's results are the same bits whatever
rows share the call. The packed copy holds the weight as it was when
packed; products of 1 to 5 rows (2 and 3 without AVX2) read the
parameter itself. Change a parameter after packing and the two disagree:
pack again (a new runner).
"""

import os
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from fairseq_stream import cpu_info
from fairseq_stream.errors import FairseqStreamError
from fairseq_stream.ops import int16_linear, quantized_linear
from fairseq_stream.ops.loader import compiled_module

Linear = Callable[[Tensor], Tensor]
PRECISIONS = ("float32", "plain") + quantized_linear.CHOICES
GEMM_VARIABLE = "FAIRSEQ_STREAM_FLOAT32_GEMM"
GEMMS = ("auto", "mkl", "onednn")
PANELS_VARIABLE = "FAIRSEQ_STREAM_FLOAT32_PANELS"
# The C++ packing reads the variable itself ("off", "all"; unset: by the weight's size).
PANEL_CHOICES = ("off", "all")
# Weights (out x in values) from which oneDNN's GEMM takes the float32 product on a CPU that is not Intel's.
ONEDNN_FROM_WEIGHTS = 1 << 20


def _extension():
    module = compiled_module("cpu")
    return module if module is not None and hasattr(module, "Product") else None


def missing_reason() -> str:
    """Why the float32 (MKL-packed) product cannot run in this process ("" where it can)."""
    module = _extension()
    if module is None:
        return "the compiled CPU extension is not built"
    return module.prepacked_linear_missing()


def available() -> bool:
    """Whether :func:`linear` can pack float32 CPU weights for MKL here."""
    return missing_reason() == ""


def onednn_missing_reason() -> str:
    """Why oneDNN's float32 GEMM cannot run in this process ("" where it can)."""
    module = _extension()
    if module is None:
        return "the compiled CPU extension is not built"
    if not hasattr(module, "onednn_linear_missing"):  # built from older sources: setup_env.sh rebuilds it
        return "the compiled CPU extension predates oneDNN's float32 GEMM (rebuild it: scripts/setup_env.sh)"
    return module.onednn_linear_missing()


def float32_gemm(out_features: int, in_features: int, environ=os.environ) -> str:
    """Whose GEMM multiplies a float32 weight of (out_features, in_features) above the skinny rows: "mkl" or
    "onednn".

    ``FAIRSEQ_STREAM_FLOAT32_GEMM`` (``auto``, ``mkl``, ``onednn``) chooses;
    ``auto`` (or unset) takes oneDNN's on a CPU that is not Intel's for
    weights of at least :data:`ONEDNN_FROM_WEIGHTS` values, MKL's otherwise.

    Raises FairseqStreamError for another value, or for ``onednn`` where this
    torch has no oneDNN linear ops.
    """
    asked = environ.get(GEMM_VARIABLE, "").strip().lower() or "auto"
    if asked not in GEMMS:
        raise FairseqStreamError("{}={!r}: choose auto, mkl or onednn".format(GEMM_VARIABLE, asked))
    if asked == "mkl":
        return "mkl"
    missing = onednn_missing_reason()
    if asked == "onednn":
        if missing:
            raise FairseqStreamError("{}=onednn: {}".format(GEMM_VARIABLE, missing))
        return "onednn"
    if missing or cpu_info.cpu_vendor() in ("GenuineIntel", ""):
        return "mkl"
    return "onednn" if out_features * in_features >= ONEDNN_FROM_WEIGHTS else "mkl"


def check_panels_variable(environ=os.environ):
    """Refuse a ``FAIRSEQ_STREAM_FLOAT32_PANELS`` the packing would not know (it would pack as if unset)."""
    asked = environ.get(PANELS_VARIABLE)
    if asked is not None and asked not in PANEL_CHOICES:
        raise FairseqStreamError("{}={!r}: choose off or all (unset: weights of 4M values and up in panels)"
                                 .format(PANELS_VARIABLE, asked))


def skinny_rows() -> int:
    """Up to how many rows the float32 product reads the weight once in its own layout (0 where the CPU lacks
    AVX2 and FMA).

    At those row counts each row's results are the same bits whatever rows
    share the call (``csrc/cpu/skinny_linear_cpu.cpp``).
    """
    module = _extension()
    return module.skinny_linear_rows() if module is not None else 0


def skinny_kernel() -> str:
    """The skinny product's tiles in this process: ``avx512``, ``avx2`` (also under ATEN_CPU_CAPABILITY=avx2), or ""."""
    module = _extension()
    return module.skinny_linear_kernel() if module is not None else ""


class TorchLinear:
    """``F.linear(x, weight, bias)`` as a callable: the "plain" product, and float32's where it cannot be packed."""

    def __init__(self, weight: Tensor, bias: Optional[Tensor]):
        self.weight, self.bias = weight, bias

    def __call__(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


def linear(weight: Tensor, bias: Optional[Tensor] = None, precision: str = "float32", kernel: str = "auto") -> Linear:
    """The product ``x W^T + b`` at ``precision`` (one of :data:`PRECISIONS`): a callable on inputs of any
    leading shape.

    Args:
        weight: (out, in).
        bias: (out,) or None.
        precision: "float32" (packed for MKL where it applies, else torch's), "plain" (torch's ``F.linear``),
            "int8" (its weights' width chosen for this CPU), "int8w8", "int8w7" or "int16".
        kernel: int8 and int16: "auto" (the best this CPU runs), one of the precision's kernels
            (:func:`fairseq_stream.ops.quantized_linear.kernels`), or "onednn" (int8); float32: "auto"
            (:func:`float32_gemm`), "mkl" or "onednn", the GEMM above the skinny rows.

    Raises RuntimeError for a quantized precision where the compiled extension is not built.
    """
    if precision == "plain":
        return TorchLinear(weight, bias)
    if precision == "float32":
        if weight.dtype == torch.float32 and weight.device.type == "cpu" and available():
            gemm = float32_gemm(*weight.shape) if kernel == "auto" else kernel
            check_panels_variable()
            # Packing reads the values only: no autograd graph follows the copy.
            return _extension().Product(weight.detach(), bias.detach() if bias is not None else None, "float32",
                                        kernel=gemm)
        return TorchLinear(weight, bias)
    if precision in quantized_linear.INT8_KINDS:
        return _int8(weight, bias, precision, kernel)
    if precision == "int16":
        return of_int16(int16_linear.pack(weight, bias), kernel)
    raise ValueError("unknown quantization {!r} (choose from: {})".format(
        precision, ", ".join(quantized_linear.CHOICES)))


def _quantized_extension(precision: str):
    module = _extension()
    if module is None:
        raise RuntimeError("{} products need the compiled CPU kernels: the compiled CPU extension is not "
                           "built".format(precision))
    return module


def _int8(weight: Tensor, bias: Optional[Tensor], kind: str, kernel: str):
    """The compiled int8 ``Product`` on ``weight`` quantized to ``kind`` (int8, int8w8, int8w7)."""
    module = _quantized_extension("--quantize " + kind)
    Q = quantized_linear
    p = Q.pack_int8(weight, bias, Q.int8_weight_bits(kind))
    # oneDNN's GEMM takes calls of many rows where it sums exactly (AMX or VNNI): it keeps the weight a
    # second time, transposed (int8: half a float32 copy for both).
    from_rows = Q.onednn_from_rows(p.in_features)
    onednn = Q.onednn_exact() and (kernel == "onednn" or from_rows < Q.NEVER)
    weight_kn = Q.int8_weight(p).t().contiguous() if onednn else None
    return module.Product(None, p.bias, "int8", packed=Q.packed_for(p, kernel), weight_inv=p.weight_inv,
                          excess=p.excess, weight_max=p.weight_max, in_features=p.in_features,
                          out_features=p.out_features, kernel=kernel, weight_kn=weight_kn,
                          onednn_from_rows=from_rows)


def of_int16(p: int16_linear.PackedLinear, kernel: str = "auto"):
    """The compiled int16 ``Product`` on the packed int16 weight ``p`` (its tensors, not a copy): the
    transformer's --quantize int16 products and the LSTM's --rnn-int16 ones alike."""
    module = _quantized_extension("int16")
    return module.Product(None, p.bias, "int16", packed=p.packed, weight_inv=p.weight_inv, a_max=p.a_max,
                          in_features=p.in_features, out_features=p.out_features, kernel=kernel)


def compiled(module, product: Linear):
    """The compiled ``Product`` that a compiled step takes for ``product`` (one of :func:`linear`'s): the
    product itself where it is compiled, a "plain" one on a :class:`TorchLinear`'s weight; None where it
    cannot be described (a weight off the CPU)."""
    if isinstance(product, TorchLinear):
        if product.weight.device.type != "cpu":
            return None
        return module.Product(product.weight, product.bias, "plain")
    return product
