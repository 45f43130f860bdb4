"""The int8 format of the product op for ``--quantize int8|int16``: ``y = x W^T + b`` in integers.

The weight is quantized once, one scale per output row; each call quantizes
each row of ``x`` with a scale of its own, sums the integer products exactly
in int32 and dequantizes: ``y[m, n] = (float(acc[m, n]) * inv_a[m]) *
inv_w[n] + b[n]``, each a float32 operation, with ``inv_a[m] = float32(1 /
s_a[m])`` and ``inv_w[n] = float32(1 / s_w[n])`` (Devlin 2017, section 3; the
same dequantization as :mod:`fairseq_stream.ops.int16_linear`).

**int8** (:func:`pack_int8`, ``csrc/cpu/int8_linear_cpu.cpp`` on the driver
int16 shares, ``quantized_product_cpu.cpp``): row ``n`` of
the weight is scaled by ``s_w[n] = 127 / max_k |W[n, k]|`` and rounded, so
its largest weight is +-127; row ``m`` of ``x`` by ``s_a[m] = 127 / max_k
|x[m, k]|`` (1 for an all-zero row): values in [-127, 127], -128 unused, as
CTranslate2's int8 does. Kernels: AVX-512 VNNI (``vpdpbusd``, with the
row's values shifted to unsigned bytes and the shift's known excess, 128
times each weight row's sum, taken off), AVX2 (the weights widened to int16,
``vpmaddwd``; it reads the packed bytes in :func:`pair_order`) and portable loops; and for calls of many rows with long
weight rows, oneDNN's int8 GEMM (``torch._int_mm``), where a check at first
use finds it exact on this CPU (AMX or VNNI; :func:`onednn_from_rows` says
when). Every kernel computes the same integer sums, so a row's result is the
same bits whatever rows share its call and whichever kernel ran it.

**7-bit weights** (``int8w7``): the same, with ``s_w[n] = 63 / max_k |W[n,
k]|``. Then AVX2's ``vpmaddubsw`` (unsigned row bytes times signed weights,
pairs summed into int16) cannot saturate, ``2 * 255 * 63 < 2^15``, and the
"avx2w7" kernel multiplies 32 bytes an instruction where the widened kernel
multiplies 16: about a quarter less time a product on AVX2. The other kernels
sum 7-bit weights as they sum 8-bit ones. ``int8`` is the faster form of the
CPU (:func:`int8_weight_bits`): 7-bit weights where AVX2 is the best int8
code, 8-bit where VNNI (or only the portable loops) runs; ``int8w8`` and
``int8w7`` fix the form, for the same bits on every machine.

**No overflow, int8.** Every partial sum of the int32 accumulator is at most
``255 * 127 * in_features`` in magnitude on the VNNI kernel (``127 * 127 *
in_features`` on the others): below ``2^31`` for any input up to
:data:`INT8_MAX_IN_FEATURES` input features, which :func:`pack_int8` checks.
No instruction saturates (vpdpbusd sums four byte products into 32 bits;
vpmaddwd two int16 products into 32 bits).

**Rows integers cannot hold.** A row of ``x`` with a NaN or an infinity, or
with values so small that ``127 / max |x|`` overflows float32, has no
integer form: every kernel multiplies it in float32 on the dequantized
weight instead, as the reference does
(:func:`fairseq_stream.ops.int16_linear.float_product`), bit for bit.

**int16** is :mod:`fairseq_stream.ops.int16_linear`'s packing and kernels
(the int16 LSTM's), whose scale rule balances the two sides' precision under
the same no-overflow bound.

This module holds the int8 format (its scale rule, packing and kernels'
list); :func:`fairseq_stream.ops.product.linear` makes the product on it (the
one compiled ``Product`` of every precision, called from Python and from the
compiled steps alike); :func:`reference_int8` is its arithmetic in torch
(int64 sums, the same roundings): identical floats, which tests check on
every kernel the CPU has.
"""

from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import Tensor

from fairseq_stream.ops import int16_linear
from fairseq_stream.ops.loader import compiled_module

# The --quantize choices: int8 (its weights' width picked for the CPU), int8 with 8- or 7-bit weights, int16.
CHOICES = ("int8", "int8w8", "int8w7", "int16")
INT8_KINDS = ("int8", "int8w8", "int8w7")
INT8_MAX = 127
INT7_MAX = 63  # the largest |w| of a 7-bit weight (int8w7)
COLS = 16  # output columns per packed panel
QUAD = 4  # input positions per packed int8 group (one vpdpbusd lane)
NEVER = 2 ** 62  # onednn_from_rows for shapes where oneDNN never pays
# 255 * 127 * in_features < 2^31 (the VNNI kernel's unsigned operand).
INT8_MAX_IN_FEATURES = (2 ** 31 - 1) // (255 * 127)


@dataclass
class Int8Packed:
    """A weight quantized to int8 and packed for the kernels."""

    packed: Tensor  # int8 (ceil(out/16), ceil(in/4), 64)
    weight_scale: Tensor  # float64 (out,): s_w
    weight_inv: Tensor  # float32 (out,): 1 / s_w
    excess: Tensor  # int32 (out,): 128 * sum_k q_w[n, k]
    in_features: int
    out_features: int
    bias: Optional[Tensor]
    a_max: int = INT8_MAX  # the largest |q_x| a row of x is scaled to
    weight_max: int = INT8_MAX  # the largest |q_w|: 127, or 63 for 7-bit weights


def pack_int8(weight: Tensor, bias: Optional[Tensor] = None, weight_bits: int = 8) -> Int8Packed:
    """Quantize ``weight`` (out, in) to int8, one scale per output row, and pack it for the kernels.

    ``weight_bits`` 7 scales each row to [-63, 63] (``int8w7``), 8 to [-127, 127].
    """
    if weight_bits not in (7, 8):
        raise ValueError("int8: weights of 7 or 8 bits, not {}".format(weight_bits))
    w_max = INT8_MAX if weight_bits == 8 else INT7_MAX
    w = weight.detach().float().cpu()
    out_features, in_features = w.shape
    if in_features > INT8_MAX_IN_FEATURES:
        raise ValueError("int8: {} input features could overflow int32 sums (at most {})".format(
            in_features, INT8_MAX_IN_FEATURES))
    peak = w.abs().amax(dim=1).double()
    scale = torch.where(peak > 0, w_max / peak.clamp_min(1e-300), torch.ones_like(peak))
    q = torch.round(w.double() * scale[:, None]).clamp_(-w_max, w_max).to(torch.int8)
    blocks, quads = -(-out_features // COLS), -(-in_features // QUAD)
    padded = torch.zeros(blocks * COLS, quads * QUAD, dtype=torch.int8)
    padded[:out_features, :in_features] = q
    # (block, column, quad, 4) -> (block, quad, column, 4): one quad of a panel is 64 adjacent bytes.
    packed = padded.view(blocks, COLS, quads, QUAD).permute(0, 2, 1, 3).reshape(blocks, quads, COLS * QUAD)
    excess = (128 * q.to(torch.int32).sum(dim=1)).to(torch.int32)
    b = bias.detach().float().cpu().contiguous() if bias is not None else None
    return Int8Packed(packed.contiguous(), scale, (1.0 / scale).float().contiguous(), excess.contiguous(),
                      in_features, out_features, b, weight_max=w_max)


def int8_weight(p: Int8Packed) -> Tensor:
    """The int8 weight (out, in) that ``p`` packs."""
    blocks, quads, _ = p.packed.shape
    full = p.packed.view(blocks, quads, COLS, QUAD).permute(0, 2, 1, 3).reshape(blocks * COLS, quads * QUAD)
    return full[:p.out_features, :p.in_features]


def pair_order(packed: Tensor) -> Tensor:
    """``packed`` with each quad's 64 bytes in the AVX2 kernel's order: the 16 columns' inputs 4p and 4p+1,
    then their 4p+2 and 4p+3 (a widened load is then 8 columns x 2 inputs: ``csrc/cpu/int8_tiles_cpu.h``)."""
    blocks, quads, _ = packed.shape
    pairs = packed.view(blocks, quads, COLS, QUAD // 2, 2).transpose(2, 3)
    return pairs.reshape(blocks, quads, COLS * QUAD).contiguous()


def packed_for(p: Int8Packed, kernel_name: str = "auto") -> Tensor:
    """``p``'s packed weight in the order the int8 kernel ``kernel_name`` reads ("auto": the best here for
    ``p``'s weights): pair order for "avx2", as packed for the others. The same bytes: it replaces
    ``p.packed``, no copy stays."""
    name = kernel(int8_kind(p)) if kernel_name == "auto" else kernel_name
    return pair_order(p.packed) if name == "avx2" else p.packed


def _extension():
    module = compiled_module("cpu")
    return module if module is not None and hasattr(module, "int8_linear") else None


def onednn_exact() -> bool:
    """Whether oneDNN's int8 GEMM (``torch._int_mm``) sums exactly on this CPU (AMX or VNNI), checked once."""
    ext = _extension()
    return ext is not None and bool(ext.int8_onednn_exact())


def onednn_from_rows(in_features: int) -> int:
    """From how many rows a call of an int8 product with ``in_features`` inputs goes to oneDNN.

    oneDNN blocks the sum over the inputs for the cache; ours streams a
    tile's whole rows, which pays at few rows (the weight read once for up to
    12 rows, no 9 us call overhead) and for short rows. Measured on one
    thread of the Xeon, whole products with quantization, 2026-11-27: at 256
    inputs (Multi30k's projections and output layer) ours is faster or level
    at every row count from 256 rows on and for 8,000 outputs at every count;
    at 512 inputs oneDNN is 1.3-1.7x faster from 64 rows; at 1,024 and 4,096
    inputs (WMT'19's) 1.0-1.9x from 128 rows.
    """
    if in_features >= 1024:
        return 128
    if in_features >= 512:
        return 64
    return NEVER


def kernels(kind: str = "int8") -> List[str]:
    """The compiled kernels of ``kind`` this CPU runs, the best last; [] unbuilt."""
    if kind == "int16":
        return int16_linear.kernels()
    ext = _extension()
    weight_max = INT7_MAX if int8_weight_bits(kind) == 7 else INT8_MAX
    return list(ext.int8_kernels(weight_max)) if ext is not None else []


def kernel(kind: str = "int8") -> str:
    """The kernel ``kind``'s products run by default here: the best of :func:`kernels`."""
    return (kernels(kind) or ["none"])[-1]


def int8_weight_bits(kind: str = "int8") -> int:
    """The width of ``kind``'s weights: 8 for int8w8, 7 for int8w7; for int8, the faster form here.

    7 where AVX2 is the best int8 code this process runs (an AVX2-only CPU,
    or torch capped at AVX2 by ``ATEN_CPU_CAPABILITY``): its ``vpmaddubsw``
    kernel needs 7-bit weights to stay exact and takes about a quarter less
    time a product than the 8-bit AVX2 kernel. 8 where VNNI sums 8-bit
    weights as fast as 7-bit ones, and where only the portable loops run.
    """
    if kind == "int8w8":
        return 8
    if kind == "int8w7":
        return 7
    if kind != "int8":
        raise ValueError("not an int8 quantization: {!r} (choose from: {})".format(kind, ", ".join(INT8_KINDS)))
    ext = _extension()
    best = list(ext.int8_kernels(INT8_MAX))[-1] if ext is not None else "none"
    return 7 if best == "avx2" else 8


def int8_kind(p: Int8Packed) -> str:
    """The fixed int8 form (int8w8 or int8w7) whose weights ``p`` holds."""
    return "int8w7" if p.weight_max == INT7_MAX else "int8w8"


def resolve(kind: str) -> str:
    """``kind`` with int8 resolved to the form this CPU runs (int8w8 or int8w7); others unchanged."""
    return "int8w{}".format(int8_weight_bits(kind)) if kind in INT8_KINDS else kind


def reference_int8(x: Tensor, p: Int8Packed) -> Tensor:
    """The int8 kernels' arithmetic in torch (int64 sums, the same roundings): identical floats."""
    return int16_linear.integer_reference(x, p.a_max, int8_weight(p), p.weight_inv, p.bias)


def int8_error_bound(x: Tensor, weight: Tensor, p: Int8Packed) -> Tensor:
    """Per output, how far the int8 product may be from ``x @ weight.T`` in exact arithmetic: the bound of
    :func:`fairseq_stream.ops.int16_linear.error_bound`, whose reasoning holds for any ``a_max`` and per-row
    weight scales."""
    return int16_linear.error_bound(x, weight, p)
