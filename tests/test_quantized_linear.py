"""The int8 linear layer (and --quantize's products): every kernel against the torch reference, bit for bit."""

import pytest
import torch

from fairseq_stream.ops import quantized_linear as Q
from fairseq_stream.ops.product import linear
from fairseq_stream.ops.output_layer import compiled_module

ALL_KERNELS = ("portable", "avx2", "avx512vnni")
KERNELS = Q.kernels("int8w8")  # those this CPU runs on 8-bit weights
KERNELS7 = Q.kernels("int8w7")  # on 7-bit weights: the same and avx2w7
# (kernel, weight bits): every kernel sums 7-bit weights too; avx2w7 only those.
EVERY_KERNEL = [pytest.param(k, bits, marks=pytest.mark.skipif(k not in KERNELS7,
                                                               reason="this CPU (or build) has no " + k))
                for bits in (8, 7) for k in ALL_KERNELS + (("avx2w7",) if bits == 7 else ())]
pytestmark = pytest.mark.skipif(not KERNELS, reason="the compiled CPU extension is not built")


def run(x, p, kernel):
    return compiled_module("cpu").int8_linear(x, Q.packed_for(p, kernel), p.weight_inv, p.excess, p.bias, kernel,
                                              p.weight_max)


@pytest.mark.parametrize("kernel, bits", EVERY_KERNEL)
@pytest.mark.parametrize("rows, in_features, out_features", [
    (1, 1, 1), (2, 3, 5), (3, 7, 17), (4, 16, 16), (5, 33, 40), (6, 40, 129), (9, 64, 33), (12, 31, 260),
    (13, 255, 129), (25, 48, 50), (14, 256, 520),
    # every tile shape's remainders: 1-2 rows (8 panels a tile), 3-4 (4), 5-12 (2), past 12 rows, part panels
])
@pytest.mark.parametrize("with_bias", [True, False])
def test_kernel_equals_the_reference_on_random_weights(kernel, bits, rows, in_features, out_features, with_bias):
    g = torch.Generator().manual_seed(rows * 1000 + in_features)
    w = torch.randn(out_features, in_features, generator=g) * 0.1
    b = torch.randn(out_features, generator=g) if with_bias else None
    x = torch.randn(rows, in_features, generator=g) * 3
    x[0, 0] = 0.0  # an exact zero, and below an all-zero row: scale 1, output the bias
    if rows > 2:
        x[2] = 0.0
    w[out_features // 2] = 0.0  # an all-zero weight row: scale 1
    p = Q.pack_int8(w, b, bits)
    y = run(x, p, kernel)
    assert torch.equal(y, Q.reference_int8(x, p))
    exact = x.double() @ w.double().t() + (b.double() if b is not None else 0)
    assert ((y.double() - exact).abs() <= Q.int8_error_bound(x, w, p)).all()


@pytest.mark.skipif(not Q.onednn_exact(), reason="oneDNN's int8 GEMM is not exact (or not used) on this CPU")
@pytest.mark.parametrize("rows, in_features, out_features", [(1, 7, 5), (13, 255, 129), (70, 512, 300)])
def test_onednn_product_equals_the_reference(rows, in_features, out_features):
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(out_features, in_features, generator=g), torch.randn(out_features, generator=g)
    x = torch.randn(rows, in_features, generator=g)
    x[0] = 0.0
    assert torch.equal(linear(w, b, "int8", "onednn")(x), Q.reference_int8(x, Q.pack_int8(w, b)))


def test_calls_of_many_rows_give_each_row_the_bits_of_a_call_of_one():
    """Where oneDNN takes the many-row calls (512 inputs, from 64 rows), a row's result is still its own."""
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(96, 512, generator=g), torch.randn(80, 512, generator=g)
    q = linear(w, None, "int8")
    together = q(x)
    assert all(torch.equal(q(x[r:r + 1]), together[r:r + 1]) for r in (0, 41, 79))


def test_every_kernel_equals_the_reference_on_the_toy_transformer(loaded):
    """Every matrix of a trained fairseq transformer, with inputs of its own scale, through QuantizedLinear."""
    models, _ = loaded("transformer")
    g = torch.Generator().manual_seed(0)
    matrices = [(n, w.detach()) for n, w in models[0].named_parameters() if w.dim() == 2]
    assert len(matrices) >= 8
    for name, w in matrices:
        x = torch.randn(7, w.shape[1], generator=g)
        for kind, kernels in (("int8w8", KERNELS), ("int8w7", KERNELS7)):
            p = Q.pack_int8(w, None, Q.int8_weight_bits(kind))
            for kernel in kernels:
                q = linear(w, None, kind, kernel)
                assert torch.equal(q(x), Q.reference_int8(x, p)), (name, kind, kernel)
                assert torch.equal(q(x.view(7, 1, -1)).view(7, -1), q(x)), "leading shapes are rows"


def test_a_row_gets_the_same_bits_whatever_rows_share_the_call():
    """Quantization is per row and sums are exact: the schedulers' exactness rests on it."""
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(300, 96, generator=g), torch.randn(20, 96, generator=g)
    for kind, kernel in [("int8w8", k) for k in KERNELS] + [("int8w7", k) for k in KERNELS7]:
        q = linear(w, torch.randn(300, generator=g), kind, kernel)
        together = q(x)
        for row in (0, 5, 19):
            assert torch.equal(q(x[row:row + 1]), together[row:row + 1])
        assert torch.equal(q(x[3:9]), together[3:9])


def test_int16_products_are_the_int16_kernels():
    from fairseq_stream.ops import int16_linear

    g = torch.Generator().manual_seed(4)
    w, b, x = torch.randn(40, 24, generator=g), torch.randn(40, generator=g), torch.randn(5, 24, generator=g)
    assert torch.equal(linear(w, b, "int16")(x), int16_linear.reference(x, int16_linear.pack(w, b)))


def test_the_scale_rule_cannot_overflow_int32():
    """The widest input allowed, every product at its largest magnitude with one sign, on every kernel."""
    k = Q.INT8_MAX_IN_FEATURES
    assert 255 * 127 * k <= 2 ** 31 - 1 < 255 * 127 * (k + 1)
    w = torch.ones(2, k)
    w[1] = -1.0
    x = torch.ones(1, k)
    p = Q.pack_int8(w)
    expected = Q.reference_int8(x, p)
    assert torch.equal(expected, torch.tensor([[float(k), -float(k)]]))
    for kernel in KERNELS:
        assert torch.equal(run(x, p, kernel), expected)
    with pytest.raises(ValueError, match="overflow"):
        Q.pack_int8(torch.ones(1, k + 1))


def test_each_row_is_scaled_to_its_own_largest_weight():
    w = torch.tensor([[1.0, -0.5, 0.25], [0.01, 0.02, -0.04]])
    q = Q.int8_weight(Q.pack_int8(w))
    assert q.tolist() == [[127, -64, 32], [32, 64, -127]]  # round half to even: 63.5 -> 64, 31.75 -> 32
    q7 = Q.int8_weight(Q.pack_int8(w, weight_bits=7))
    assert q7.tolist() == [[63, -32, 16], [16, 32, -63]]  # 31.5 -> 32, 15.75 -> 16


def test_seven_bit_kernel_sums_exactly_at_vpmaddubsw_s_largest_pair():
    """Every row byte at 255 or 1 (q = +-127) against weights of +-63: each vpmaddubsw pair sum is
    +-2 * 255 * 63 = +-32130, the largest that fits int16, on every kernel of 7-bit weights."""
    k = 256
    w = torch.ones(4, k)
    w[1] = -1.0
    w[2, ::2] = -1.0
    w[3, 1::2] = 0.5
    x = torch.ones(3, k)
    x[1] = -1.0
    x[2, 1::2] = -1.0
    p = Q.pack_int8(w, None, 7)
    expected = Q.reference_int8(x, p)
    assert torch.equal(expected[:, :2], torch.tensor([[k, -k], [-k, k], [0, 0]], dtype=torch.float32))
    for kernel in KERNELS7:
        assert torch.equal(run(x, p, kernel), expected), kernel


@pytest.mark.skipif("avx2w7" not in KERNELS7, reason="this CPU (or build) has no avx2w7")
def test_seven_bit_kernel_is_refused_on_eight_bit_weights():
    """Its int16 pair sums would saturate there: an error, never a wrong sum, and "auto" never picks it."""
    w, x = torch.randn(8, 8), torch.randn(2, 8)
    assert "avx2w7" not in KERNELS and Q.kernel("int8w8") != "avx2w7"
    with pytest.raises(RuntimeError, match="7 bits only"):
        linear(w, None, "int8w8", "avx2w7")(x)
    assert torch.equal(linear(w, None, "int8w7", "avx2w7")(x), Q.reference_int8(x, Q.pack_int8(w, None, 7)))


def test_int8_takes_seven_bit_weights_where_avx2_is_the_best_int8_code():
    assert Q.int8_weight_bits("int8w8") == 8 and Q.int8_weight_bits("int8w7") == 7
    assert Q.int8_weight_bits("int8") == (7 if Q.kernel("int8w8") == "avx2" else 8)
    assert Q.resolve("int8") == "int8w{}".format(Q.int8_weight_bits("int8"))
    assert Q.resolve("int16") == "int16"
    if Q.kernel("int8w8") == "avx2":
        assert Q.kernel("int8") == "avx2w7"


def test_unknown_kernel_and_kind_are_refused():
    w = torch.randn(4, 4)
    with pytest.raises(ValueError, match="int8, int8w8, int8w7, int16"):
        linear(w, None, "int4")
    with pytest.raises(RuntimeError, match="does not run on this CPU"):
        linear(w, None, "int8", "nosuch")(torch.randn(1, 4))
    p = Q.pack_int8(w)
    with pytest.raises(RuntimeError, match="weight_max must be 127"):
        compiled_module("cpu").int8_linear(torch.randn(1, 4), p.packed, p.weight_inv, p.excess, None, "auto", 100)
