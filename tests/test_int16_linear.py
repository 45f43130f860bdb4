"""The 16-bit fixed-point linear layer: kernels against the torch reference, the error bound, no overflow."""

import pytest
import torch

from fairseq_stream.ops import int16_linear as L

ALL_KERNELS = ("portable", "avx2", "avx512vnni")
KERNELS = L.kernels()  # those this CPU runs
# Each kernel a parameter of its own, skipped with the reason where this CPU lacks it.
EVERY_KERNEL = [pytest.param(k, marks=pytest.mark.skipif(k not in KERNELS, reason="this CPU (or build) has no " + k))
                for k in ALL_KERNELS]


def run(x, p, kernel):
    return L.int16_linear(x, p, kernel=kernel)


@pytest.mark.parametrize("kernel", EVERY_KERNEL)
@pytest.mark.parametrize("rows, in_features, out_features", [
    (1, 1, 1), (3, 7, 5), (4, 16, 16), (5, 33, 17), (6, 40, 24), (9, 64, 40), (12, 31, 33), (13, 255, 129),
    (25, 48, 50),  # every remainder of the tiles: rows past 6 and 12, a third panel, a part panel
])
@pytest.mark.parametrize("with_bias", [True, False])
def test_kernel_equals_the_reference_on_random_weights(kernel, rows, in_features, out_features, with_bias):
    g = torch.Generator().manual_seed(rows * 1000 + in_features)
    w = torch.randn(out_features, in_features, generator=g) * 0.1
    b = torch.randn(out_features, generator=g) if with_bias else None
    x = torch.randn(rows, in_features, generator=g) * 3
    x[0, 0] = 0.0  # an exact zero, and below an all-zero row: scale 1, output the bias
    if rows > 2:
        x[2] = 0.0
    p = L.pack(w, b)
    y = run(x, p, kernel)
    assert torch.equal(y, L.reference(x, p))
    exact = x.double() @ w.double().t() + (b.double() if b is not None else 0)
    assert ((y.double() - exact).abs() <= L.error_bound(x, w, p)).all()


@pytest.mark.skipif(L.kernel() == "torch", reason="the compiled extension is not built")
def test_kernel_equals_the_reference_on_the_toy_lstm(loaded):
    """Every matrix of a trained fairseq LSTM, with inputs of its own scale."""
    models, _ = loaded("lstm")
    g = torch.Generator().manual_seed(0)
    matrices = [(n, w.detach()) for n, w in models[0].named_parameters() if w.dim() == 2]
    assert len(matrices) >= 6
    for name, w in matrices:
        x = torch.randn(6, w.shape[1], generator=g)
        p = L.pack(w)
        for kernel in KERNELS:
            y = run(x, p, kernel)
            assert torch.equal(y, L.reference(x, p)), (name, kernel)
            assert ((y.double() - x.double() @ w.double().t()).abs() <= L.error_bound(x, w, p)).all(), name


@pytest.mark.parametrize("in_features", [2, 1024, 4097])
def test_the_scale_rule_cannot_overflow_int32(in_features):
    """The worst input for each row: every product at its largest magnitude with one sign."""
    for w in (torch.ones(3, in_features), torch.randn(3, in_features)):  # rho = in_features, and a typical one
        p = L.pack(w)
        q = L.quantized_weight(p).to(torch.int64)
        assert p.a_max * p.l1 <= L.INT32_MAX and p.l1 == int(q.abs().sum(dim=1).max())
        x = torch.sign(w).float()  # |x| all equal: quantized to +-a_max, signs matching the weight's
        acc = torch.round(x * p.a_max).to(torch.int64) @ q.t()
        assert int(acc.abs().max()) <= L.INT32_MAX
        if L.kernel() != "torch":
            for kernel in KERNELS:
                assert torch.equal(run(x, p, kernel), L.reference(x, p))


def test_the_scales_balance_precision_on_a_wide_layer():
    w = torch.randn(512, 1024, generator=torch.Generator().manual_seed(1))
    p = L.pack(w)
    w_max = int(L.quantized_weight(p).abs().max())
    assert 2500 < w_max < 4500 and 2500 < p.a_max < 4500
    assert p.a_max * p.l1 <= L.INT32_MAX < 2 * p.a_max * p.l1  # the bound is used, not wasted


def test_each_row_is_scaled_to_the_largest_rows_absolute_sum():
    """A row 100x smaller than another keeps its own precision: its scale is not set by the large row."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(3, 256, generator=g) * torch.tensor([[1.0], [0.1], [0.01]])
    p = L.pack(w)
    sums = L.quantized_weight(p).to(torch.int64).abs().sum(dim=1)
    assert int(sums.max()) == p.l1 and int(sums.max() - sums.min()) <= 256 // 2  # rounding moves a sum by <= in/2
    alone = L.pack(w[2:])  # the smallest row alone: the same relative step
    assert torch.allclose(p.weight_scale[2] / p.weight_scale[0], torch.tensor(100.0, dtype=torch.float64), rtol=0.2)
    # (the same within the two matrices' fan-in estimates; with one scale for the matrix it was 0.01)
    assert float(alone.weight_scale[0] / p.weight_scale[2]) == pytest.approx(1.0, rel=0.2)
    x = torch.randn(4, 256, generator=g)
    y, exact = L.reference(x, p), x.double() @ w.double().t()
    relative = ((y.double() - exact).abs() / exact.abs().amax(dim=0)).amax(dim=0)
    assert float(relative.max()) < 3 * float(relative.min())  # with one scale the smallest row was ~100x worse


@pytest.mark.skipif(not KERNELS, reason="the compiled extension is not built")
def test_auto_is_the_best_kernel_and_one_the_cpu_lacks_is_refused():
    assert KERNELS[0] == "portable" and L.kernel() == KERNELS[-1]
    assert set(KERNELS) <= set(ALL_KERNELS)
    with pytest.raises(RuntimeError, match="does not run on this CPU"):
        L.int16_linear(torch.ones(1, 2), L.pack(torch.ones(1, 2)), kernel="sse9")
