"""The compiled kernels on the inputs a sanitizer build found undefined (issue 49, item 12): rows the quantized
products cannot scale (a NaN, an infinity, only tiny values), a NaN through the exp of the attention and the LSTM
step, and arguments of the wrong size, which must be refused in one line, never read past their end.

Each quantized product gives, on such a row, the float32 product on its dequantized weight (the references
compute it the same way: the same bits, NaN where they have NaN), which is what float32 gives on the original
weight: NaN where it has NaN, the same infinities, finite values within the quantization's error bound.
``scripts/sanitize_kernels.sh`` runs this file under AddressSanitizer and UBSan.
"""

import math

import pytest
import torch

from fairseq_stream.ops import int16_linear as L
from fairseq_stream.ops import quantized_linear as Q
from fairseq_stream.ops import rnn_step
from fairseq_stream.ops.output_layer import compiled_module

EXT = compiled_module("cpu")
pytestmark = pytest.mark.skipif(EXT is None or not hasattr(EXT, "QuantizedLinear"),
                                reason="the compiled CPU extension is not built")
INF, NAN = math.inf, math.nan

torch.set_num_threads(1)


# -- rows the integers cannot hold ------------------------------------------------------------------------------


def awkward_rows(k, g):
    """Rows of k values: ordinary ones around each kind the integers cannot hold (the name says which)."""
    rows = {name: torch.randn(k, generator=g) for name in (
        "ordinary", "nan", "+inf", "-inf", "both infinities", "nan and inf", "tiny", "one tiny", "zero", "huge")}
    rows["nan"][k // 2] = NAN
    rows["+inf"][0] = INF
    rows["-inf"][k - 1] = -INF
    rows["both infinities"][0], rows["both infinities"][k - 1] = INF, -INF
    rows["nan and inf"][0], rows["nan and inf"][k - 1] = NAN, INF
    rows["tiny"] = torch.full((k,), 1e-40) * torch.sign(rows["tiny"])  # subnormal: 127 / 1e-40 overflows
    rows["one tiny"] = torch.zeros(k)
    rows["one tiny"][k // 3] = -3e-39
    rows["zero"] = torch.zeros(k)
    rows["huge"] = rows["huge"] * 1e30  # finite: a small scale, sums far from overflowing float32
    return list(rows), torch.stack(list(rows.values()))


def weights(out_features, in_features, g):
    """Weights of magnitude 0.5 to 1 in each row: none quantizes to 0, so an infinity times a weight is an infinity
    for the quantized product as for the float one."""
    magnitude = 0.5 + 0.5 * torch.rand(out_features, in_features, generator=g)
    return magnitude * torch.where(torch.rand(out_features, in_features, generator=g) < 0.5, -1.0, 1.0)


def same_bits_or_nan(got, want, context=""):
    """Equal where ``want`` is a number, NaN exactly where it is NaN (NaN's sign and payload aside)."""
    assert torch.equal(got.isnan(), want.isnan()), context
    assert torch.equal(torch.where(want.isnan(), 0.0, got), torch.where(want.isnan(), 0.0, want)), context


def agrees_with_float32(y, x, w, b, bound):
    """``y`` against the float32 product on the original weight: NaN where it has NaN, the same infinities, and
    finite values within ``bound`` of the exact product."""
    want = x @ w.t() + (b if b is not None else 0)
    assert torch.equal(y.isnan(), want.isnan())
    infinite = want.isinf()
    assert torch.equal(y.isinf(), infinite) and torch.equal(y[infinite], want[infinite])
    finite = torch.isfinite(x).all(dim=1)
    exact = x[finite].double() @ w.double().t() + (b.double() if b is not None else 0)
    assert ((y[finite].double() - exact).abs() <= bound[finite]).all()


@pytest.mark.parametrize("kernel, bits", [(k, bits) for bits in (8, 7) for k in Q.kernels("int8w{}".format(bits))])
@pytest.mark.parametrize("with_bias", [True, False])
def test_int8_rows_that_cannot_be_scaled_give_the_float32_product(kernel, bits, with_bias):
    g = torch.Generator().manual_seed(bits)
    names, x = awkward_rows(37, g)
    w = weights(21, 37, g)
    b = torch.randn(21, generator=g) if with_bias else None
    p = Q.pack_int8(w, b, bits)
    y = EXT.int8_linear(x, Q.packed_for(p, kernel), p.weight_inv, p.excess, p.bias, kernel, p.weight_max)
    same_bits_or_nan(y, Q.reference_int8(x, p))
    assert y[names.index("nan")].isnan().all() and not y[names.index("ordinary")].isnan().any()
    agrees_with_float32(y, x, w, b, Q.int8_error_bound(x.nan_to_num(0.0, 0.0, 0.0), w, p))
    # Each row alone gives its bits in a call of many rows (12 to a tile: the odd rows share tiles with them).
    for i in range(x.size(0)):
        alone = EXT.int8_linear(x[i:i + 1], Q.packed_for(p, kernel), p.weight_inv, p.excess, p.bias, kernel,
                                p.weight_max)
        same_bits_or_nan(alone, y[i:i + 1])


@pytest.mark.skipif(not Q.onednn_exact(), reason="oneDNN's int8 GEMM is not exact (or not used) on this CPU")
def test_onednn_rows_that_cannot_be_scaled_give_the_float32_product():
    g = torch.Generator().manual_seed(3)
    names, x = awkward_rows(512, g)
    w, b = weights(40, 512, g), torch.randn(40, generator=g)
    y = Q.linear(w, b, "int8w8", "onednn")(x)
    p = Q.pack_int8(w, b)
    same_bits_or_nan(y, Q.reference_int8(x, p))
    agrees_with_float32(y, x, w, b, Q.int8_error_bound(x.nan_to_num(0.0, 0.0, 0.0), w, p))


@pytest.mark.parametrize("kernel", L.kernels())
@pytest.mark.parametrize("with_bias", [True, False])
def test_int16_rows_that_cannot_be_scaled_give_the_float32_product(kernel, with_bias):
    g = torch.Generator().manual_seed(16)
    names, x = awkward_rows(33, g)
    w = weights(19, 33, g)
    b = torch.randn(19, generator=g) if with_bias else None
    p = L.pack(w, b)
    y = L.int16_linear(x, p, kernel)
    same_bits_or_nan(y, L.reference(x, p))
    assert y[names.index("+inf")].isinf().all()
    agrees_with_float32(y, x, w, b, L.error_bound(x.nan_to_num(0.0, 0.0, 0.0), w, p))


def test_the_reference_names_the_rows_it_multiplies_in_float():
    g = torch.Generator().manual_seed(0)
    names, x = awkward_rows(8, g)
    peak = x.abs().amax(dim=1)
    scale = torch.where(peak > 0, 127.0 / peak, torch.ones_like(peak))
    in_float = [names[i] for i in L.float_rows(x, scale).nonzero().flatten().tolist()]
    assert in_float == ["nan", "+inf", "-inf", "both infinities", "nan and inf", "tiny", "one tiny"]


# -- the exp of the attention and of the LSTM step -----------------------------------------------------------------


def test_exp_approx_gives_nan_for_nan_and_its_clamped_values_for_infinities():
    x = torch.tensor([NAN, -NAN, INF, -INF, 0.0, -87.0, 88.0])
    got = rnn_step.exp_approx(x)
    assert got[:2].isnan().all()
    assert got[2:].tolist() == rnn_step.exp_approx(torch.tensor([88.0, -87.0, 0.0, -87.0, 88.0])).tolist()
    assert got[4] == 1.0
    assert rnn_step.sigmoid_approx(x)[:2].isnan().all() and rnn_step.tanh_approx(x)[:2].isnan().all()
    assert rnn_step.tanh_approx(x)[2:4].tolist() == [1.0, -1.0]


def test_attention_with_a_nan_query_gives_nan_for_that_row_only():
    g = torch.Generator().manual_seed(1)
    H, hd, T = 2, 8, 5
    q = torch.randn(3, H * hd, generator=g)
    q[1, 0] = NAN
    keys, values = torch.randn(2, H, T, hd, generator=g), torch.randn(2, H, T, hd, generator=g)
    out = EXT.source_attention(q, keys, values, torch.tensor([0, 1, 1]), None, 0.5)
    assert out[1, :hd].isnan().all() and torch.isfinite(out[1, hd:]).all()
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[2]).all()


