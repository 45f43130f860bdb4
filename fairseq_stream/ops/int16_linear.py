"""16-bit fixed-point linear layer (Devlin 2017, section 3): ``y = x W^T + b`` in int16 x int16 -> int32.

The weight is quantized and packed once (:func:`pack`); each call quantizes
its rows of ``x``, sums the products in int32 and dequantizes (the compiled
``int16_linear`` in ``csrc/cpu/int16_linear_cpu.cpp``, the product op that
int8 shares (``quantized_product_cpu.cpp``): register-blocked micro-kernels
over the packed layout, AVX-512 VNNI ``vpdpwssd`` or AVX2
``vpmaddwd``, chosen at run time from what the CPU has, or portable loops;
:func:`reference` is the same arithmetic in torch, and all give identical
floats).

**Scale rule.** Each output row ``n`` of the weight has its own scale.
With ``peak = max |W|`` and the effective fan-in ``rho = max_n sum_k
|W[n, k]| / peak`` (at most ``in_features``), the row with the largest
absolute sum reaches ``l1* = w_max * rho`` with ``w_max = min(32767,
floor(sqrt((2^31 - 1) / rho)))``; every row is scaled so that its absolute
sum reaches the same ``l1*`` where its largest weight allows it: ``s_w[n] =
min(l1* / sum_k |W[n, k]|, 32767 / max_k |W[n, k]|)``, then rounded. ``l1 =
max_n sum_k |q_w[n, k]|`` is the largest quantized row sum. Each row of
``x`` is scaled by ``s_a = a_max / max_k |x[k]|`` with ``a_max = min(32767,
(2^31 - 1) // l1)``.

Why per row: with one scale for the whole matrix (as before), every row's
step was set by the matrix's largest row, and a row with half that absolute
sum was represented with one bit less than it could be. The toy LSTM trained
on an AVX2-only CPU has such rows in its attention projections, and its
worst sentence's score moved 1.7e-3 from fairseq's under int16 (5.6e-4 with
per-row scales; the kernels themselves give identical bits on every CPU).

**No overflow.** Every partial sum of the int32 accumulator, and each of
``vpmaddwd``'s pair sums, is at most ``max |q_x| * sum_k |q_w[n, k]| <= a_max
* l1 <= 2^31 - 1`` in magnitude, for any input and any summation order: the
bound holds by construction, not by the model's sizes. Balancing the two
maxima (both about ``sqrt(2^31 / rho)``) gives each side the same relative
precision: for a 1024-wide layer of Gaussian weights, ``rho`` is about 200
and both are about 3,200, so a value is represented to about 1.5e-4 of its
row's (or the weight's) largest magnitude.

**Dequantization** of output ``(m, n)``: ``(float(acc) * inv_a[m]) *
inv_w[n] + b[n]``, each a float32 operation, with ``inv_a[m] = float32(1 /
s_a[m])`` and ``inv_w[n] = float32(1 / s_w[n])``.

**Rows integers cannot hold** (:func:`float_rows`: a NaN or an infinity in
the row, or values so small that its scale overflows float32) are multiplied
in float32 on the dequantized weight (:func:`float_product`), by the kernels
and the reference alike: a NaN gives NaN outputs, an infinity what float32
gives. Converting them to integers would be undefined behaviour in C++.

**Error bound** against float arithmetic, per output: ``|y - y_float| <=
||x||_1 / (2 s_w[n]) + ||W[n]||_1 / (2 s_a) + in_features / (4 s_a s_w[n])``,
plus float32 rounding of the int32 sum's conversion, the two multiplies and
the add (:func:`error_bound`).
"""

import math
from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import Tensor

from fairseq_stream.ops.loader import compiled_module

INT32_MAX = 2 ** 31 - 1
INT16_MAX = 32767
COLS = 16  # output columns per packed panel (one 512-bit register of int32 sums, or two 256-bit)


@dataclass
class PackedLinear:
    """A weight quantized and packed for :func:`int16_linear`."""

    packed: Tensor  # int16 (ceil(out/16), ceil(in/2), 32)
    weight_scale: Tensor  # float64 (out,): s_w, one per output row
    weight_inv: Tensor  # float32 (out,): 1 / s_w, as the kernels dequantize with it
    a_max: int  # the largest |q_x| a row of x is scaled to
    l1: int  # the largest sum_k |q_w[n, k]| (the overflow bound's other factor)
    in_features: int
    out_features: int
    bias: Optional[Tensor]  # float32 (out,) or None


def pack(weight: Tensor, bias: Optional[Tensor] = None) -> PackedLinear:
    """Quantize ``weight`` (out, in) by the module's scale rule and pack it for the kernel."""
    w = weight.detach().float().cpu()
    out_features, in_features = w.shape
    row_peak = w.abs().amax(dim=1).double()
    row_l1 = w.abs().sum(dim=1).double()
    peak = float(row_peak.max())
    if peak == 0.0:
        peak = 1.0
    rho = max(float(row_l1.max()) / peak, 1.0)
    w_max = min(INT16_MAX, int(math.floor(math.sqrt(INT32_MAX / rho))))
    target_l1 = w_max * rho  # what the largest row's absolute sum is scaled to
    weight_scale = torch.minimum(target_l1 / row_l1.clamp_min(1e-300), INT16_MAX / row_peak.clamp_min(1e-300))
    weight_scale = torch.where(row_peak > 0, weight_scale, torch.ones_like(weight_scale))  # an all-zero row
    q = torch.round(w.double() * weight_scale[:, None]).clamp_(-INT16_MAX, INT16_MAX).to(torch.int16)
    l1 = int(q.abs().to(torch.int64).sum(dim=1).max())
    a_max = min(INT16_MAX, INT32_MAX // max(l1, 1))
    blocks, pairs = -(-out_features // COLS), -(-in_features // 2)
    padded = torch.zeros(blocks * COLS, pairs * 2, dtype=torch.int16)
    padded[:out_features, :in_features] = q
    # (block, column, pair, 2) -> (block, pair, column, 2): one k-pair of 8 columns is 16 adjacent int16.
    packed = padded.view(blocks, COLS, pairs, 2).permute(0, 2, 1, 3).reshape(blocks, pairs, 2 * COLS).contiguous()
    b = bias.detach().float().cpu().contiguous() if bias is not None else None
    weight_inv = (1.0 / weight_scale).float().contiguous()
    return PackedLinear(packed, weight_scale, weight_inv, a_max, l1, in_features, out_features, b)


def quantized_weight(p: PackedLinear) -> Tensor:
    """The int16 weight (out, in) that ``p`` packs."""
    blocks, pairs, _ = p.packed.shape
    full = p.packed.view(blocks, pairs, COLS, 2).permute(0, 2, 1, 3).reshape(blocks * COLS, pairs * 2)
    return full[:p.out_features, :p.in_features]


def _extension():
    return compiled_module("cpu")


def kernels() -> List[str]:
    """The compiled kernels this CPU runs, the best last ("portable", "avx2", "avx512vnni"); [] unbuilt."""
    ext = _extension()
    if ext is None or not hasattr(ext, "int16_kernels"):
        return []
    return list(ext.int16_kernels())


def kernel() -> str:
    """Which kernel :func:`int16_linear` runs by default: the best of :func:`kernels`, or "torch"."""
    return (kernels() or ["torch"])[-1]


def int16_linear(x: Tensor, p: PackedLinear, kernel: str = "auto") -> Tensor:
    """``x`` (rows, in) float32 times the packed weight, plus its bias: (rows, out) float32.

    ``kernel``: "auto" (the best this CPU has) or one of :func:`kernels` (tests
    compare them all). Without the compiled extension it runs :func:`reference`.
    """
    ext = _extension()
    if ext is None or not hasattr(ext, "int16_linear"):
        return reference(x, p)
    return ext.int16_linear(x.float(), p.packed, p.weight_inv, p.a_max, p.bias, kernel)


def reference(x: Tensor, p: PackedLinear) -> Tensor:
    """The kernel's arithmetic in torch (int64 sums, the same roundings): identical floats."""
    return integer_reference(x, p.a_max, quantized_weight(p), p.weight_inv, p.bias)


def integer_reference(x: Tensor, a_max: int, weight: Tensor, weight_inv: Tensor, bias: Optional[Tensor]) -> Tensor:
    """The quantized kernels' arithmetic in torch, for a weight already quantized (any integer type).

    Each row of ``x`` scaled to ``a_max`` by its largest magnitude and
    rounded, the sums in int64 (the kernels' int32 sums, which never
    overflow, are the same integers), each output dequantized as ``(float(acc)
    * inv_a) * inv_w + b`` in float32. The int16 kernels' (``a_max`` from the
    scale rule) and the int8 ones' (``a_max`` = 127,
    :mod:`fairseq_stream.ops.quantized_linear`).

    A row that integers cannot hold (:func:`float_rows`) is multiplied in
    float32 instead, by :func:`float_product`.
    """
    x = x.float()
    peak = x.abs().amax(dim=1)
    scale = torch.where(peak > 0, torch.tensor(float(a_max)) / peak, torch.ones_like(peak))
    in_float = float_rows(x, scale)
    scale = torch.where(in_float, torch.ones_like(scale), scale)  # their integer sums are not used
    qx = torch.round(torch.where(in_float[:, None], 0.0, x) * scale[:, None]).to(torch.int64)
    acc = qx @ weight.to(torch.int64).t()
    inv_a = (1.0 / scale.double()).float()
    y = (acc.float() * inv_a[:, None]) * weight_inv[None, :]
    y = y + bias if bias is not None else y
    if in_float.any():
        y[in_float] = float_product(x[in_float], weight, weight_inv, bias)
    return y


def float_rows(x: Tensor, scale: Tensor) -> Tensor:
    """Which rows of ``x`` (rows, in) the quantized kernels multiply in float32: those holding a NaN or an
    infinity, and those whose scale ``a_max / max |x|`` (``scale``, float32) overflows, values so small
    (all below ``a_max / 3.4e38``: 3.7e-37 for int8) that no integer scale exists in float32.

    Rounding such a row to integers would convert a NaN or an infinity to an integer, which C++ leaves
    undefined (x86 gives INT_MIN: a NaN row came out finite, a +inf row NaN).
    """
    return ~torch.isfinite(x).all(dim=1) | ~torch.isfinite(scale)


def float_product(x: Tensor, weight: Tensor, weight_inv: Tensor, bias: Optional[Tensor]) -> Tensor:
    """The quantized kernels' outputs for rows that integers cannot hold (:func:`float_rows`): the float32
    product on the dequantized weight, ``sum_k x[k] * (float(w[n, k]) * inv_w[n]) + b[n]``, each product and
    sum rounded to float32 in order of ``k``, as the kernels compute it (``float_row`` in
    ``csrc/cpu/quantized_tiles_cpu.h``): the same bits. As float arithmetic has it, a NaN makes every output
    of its row NaN, an infinity gives +-inf (NaN where its weight is 0 or infinities of both signs meet), and
    values too small to scale give about the bias.
    """
    dequantized = weight.float() * weight_inv[:, None]  # (out, in)
    acc = torch.zeros(x.size(0), weight.size(0))
    for k in range(x.size(1)):
        acc = acc + x[:, k:k + 1] * dequantized[None, :, k]
    return acc + bias if bias is not None else acc


def error_bound(x: Tensor, weight: Tensor, p) -> Tensor:
    """Per output, how far :func:`int16_linear` may be from ``x @ weight.T`` in exact arithmetic.

    ``p``: a :class:`PackedLinear`, or any packed weight with its ``a_max``,
    ``weight_scale``, ``in_features`` and ``bias`` (the int8 one of
    :mod:`fairseq_stream.ops.quantized_linear`): rounding moves each
    quantized value by at most half a step on either side.
    """
    x, w = x.double(), weight.double()
    peak = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-300)
    s_a = p.a_max / peak
    s_w = p.weight_scale[None, :]
    quantization = (x.abs().sum(dim=1, keepdim=True) / (2 * s_w) + w.abs().sum(dim=1)[None, :] / (2 * s_a)
                    + p.in_features / (4 * s_a * s_w))
    # float32 rounding of the int32 sum's conversion, the two multiplies (and of inv_a and inv_w themselves)
    # and the bias add: 6 half-ulps of the result bound them generously.
    magnitude = (x.abs() @ w.abs().t()) + quantization + (p.bias.abs().double() if p.bias is not None else 0)
    return quantization + 6 * magnitude * 2.0 ** -24
