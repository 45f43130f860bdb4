"""The prepacked float32 product (MKL's packed sgemm or oneDNN's GEMM) against float64, and where the lean runner uses
it."""

import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import run_tool
from fairseq_stream import cpu_info
from fairseq_stream.errors import FairseqStreamError
from fairseq_stream.ops import product as P

needs_mkl = pytest.mark.skipif(not P.available(), reason="no prepacked product here: " + (P.missing_reason() or ""))
# Each GEMM the float32 product can take, oneDNN's where this torch has its linear ops.
GEMMS = ["mkl", pytest.param("onednn", marks=pytest.mark.skipif(
    not P.available() or P.onednn_missing_reason() != "",
    reason="no oneDNN linear ops here: " + (P.onednn_missing_reason() if P.available() else "")))]


def float32_bound(x, w, b):
    """Two float32 sums of the same products in any order differ from the exact sum by at most this (per output)."""
    k = x.size(-1)
    magnitude = x.double().abs() @ w.double().abs().t() + (b.double().abs() if b is not None else 0)
    return 2 * k * torch.finfo(torch.float32).eps * magnitude + 1e-30


@needs_mkl
@pytest.mark.parametrize("gemm", GEMMS)
@pytest.mark.parametrize("out_features, in_features", [(1, 1), (17, 5), (768, 256), (256, 1024), (1000, 256)])
@pytest.mark.parametrize("rows", [0, 1, 2, 5, 13, 64, 301])
@pytest.mark.parametrize("with_bias", [True, False])
def test_equals_float64_within_float32_rounding(out_features, in_features, rows, with_bias, gemm):
    g = torch.Generator().manual_seed(rows * 7 + in_features)
    w = torch.randn(out_features, in_features, generator=g) * 0.1
    b = torch.randn(out_features, generator=g) if with_bias else None
    x = torch.randn(rows, in_features, generator=g)
    f = P.linear(w, b, kernel=gemm)
    assert not isinstance(f, P.TorchLinear) and f.kernel == gemm
    exact = F.linear(x.double(), w.double(), b.double() if b is not None else None)
    # The call (the skinny product at its rows) and the GEMM alone at every row count.
    for y in (f(x), f.gemm_product(x)):
        assert y.shape == (rows, out_features) and y.dtype == torch.float32
        assert ((y.double() - exact).abs() <= float32_bound(x, w, b)).all()


@needs_mkl
@pytest.mark.parametrize("gemm", GEMMS)
def test_leaves_weight_and_bias_alone_and_repeats_itself(gemm):
    # One row once wrote its output into the bias (expand().contiguous() of one row is the bias itself).
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(40, 24, generator=g), torch.randn(40, generator=g)
    w0, b0 = w.clone(), b.clone()
    f = P.linear(w, b, kernel=gemm)
    x = torch.randn(1, 24, generator=g)
    first, gemm_first = f(x), f.gemm_product(x)
    for rows in (1, 3, 1, 70):
        f(torch.randn(rows, 24, generator=g))
        f.gemm_product(torch.randn(rows, 24, generator=g))
    assert torch.equal(f(x), first) and torch.equal(f.gemm_product(x), gemm_first)
    assert torch.equal(w, w0) and torch.equal(b, b0)


@pytest.mark.parametrize("vendor, shape, asked, want", [
    ("GenuineIntel", (8008, 256), "", "mkl"),
    ("", (8008, 256), "", "mkl"),
    ("AuthenticAMD", (8008, 256), "", "onednn"),
    ("AuthenticAMD", (1024, 1024), "auto", "onednn"),
    ("AuthenticAMD", (768, 256), "", "mkl"),
    ("AuthenticAMD", (8008, 256), "mkl", "mkl"),
    ("GenuineIntel", (256, 256), " OneDNN ", "onednn"),
])
def test_the_float32_gemm_is_onednns_for_large_weights_off_intel_or_as_asked(monkeypatch, vendor, shape, asked, want):
    """MKL runs its generic code on CPUs that are not Intel's: there oneDNN takes the weights large enough."""
    monkeypatch.setattr(cpu_info, "cpu_vendor", lambda: vendor)
    if want == "onednn" and P.onednn_missing_reason():
        want = "mkl" if asked.strip().lower() in ("", "auto") else None
    environ = {P.GEMM_VARIABLE: asked} if asked else {}
    if want is None:
        with pytest.raises(FairseqStreamError, match="onednn"):
            P.float32_gemm(*shape, environ=environ)
    else:
        assert P.float32_gemm(*shape, environ=environ) == want


def test_an_unknown_float32_gemm_is_refused_in_one_line():
    with pytest.raises(FairseqStreamError, match="FAIRSEQ_STREAM_FLOAT32_GEMM='blas': choose auto, mkl or onednn"):
        P.float32_gemm(10, 10, environ={P.GEMM_VARIABLE: "blas"})


def test_an_unknown_panels_value_is_refused_in_one_line():
    """The packing reads only "off" and "all": "on", a typo, would silently pack as if unset."""
    with pytest.raises(FairseqStreamError, match="FAIRSEQ_STREAM_FLOAT32_PANELS='on': choose off or all"):
        P.check_panels_variable({P.PANELS_VARIABLE: "on"})
    for fine in ({}, {P.PANELS_VARIABLE: "off"}, {P.PANELS_VARIABLE: "all"}):
        P.check_panels_variable(fine)


@needs_mkl
def test_any_leading_shape_and_strided_input():
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(30, 16, generator=g), torch.randn(30, generator=g)
    f = P.linear(w, b)
    x = torch.randn(3, 4, 32, generator=g)[..., ::2]  # (3, 4, 16), not contiguous
    y = f(x)
    assert y.shape == (3, 4, 30)
    assert torch.allclose(y, F.linear(x, w, b), rtol=0, atol=1e-5)
    with pytest.raises(RuntimeError, match="16 features"):
        f(torch.randn(2, 15))


@needs_mkl
@pytest.mark.skipif(P.skinny_rows() > 0, reason="this CPU has AVX2: few rows take the skinny product")
def test_two_and_three_rows_are_torchs_product():
    """Without AVX2, at 2 and 3 rows MKL's unpacked path beats the packed one: the product is F.linear's, bitwise."""
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(300, 64, generator=g), torch.randn(300, generator=g)
    f = P.linear(w, b)
    for rows in (2, 3):
        x = torch.randn(rows, 64, generator=g)
        assert torch.equal(f(x), F.linear(x, w, b))
        assert torch.equal(P.linear(w, None)(x), F.linear(x, w))


@needs_mkl
@pytest.mark.skipif(P.skinny_rows() == 0, reason="no skinny product here: the CPU lacks AVX2 and FMA")
@pytest.mark.parametrize("out_features, in_features", [(1, 1), (17, 5), (40, 37), (300, 64), (8008, 256)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_few_rows_give_each_row_the_same_bits_whatever_shares_the_call(out_features, in_features, with_bias):
    """A row's outputs from the skinny product do not depend on the rows beside it (a Jacobi window, a beam)."""
    g = torch.Generator().manual_seed(out_features + in_features)
    w = torch.randn(out_features, in_features, generator=g) * 0.1
    b = torch.randn(out_features, generator=g) if with_bias else None
    f = P.linear(w, b)
    most = P.skinny_rows()
    x = torch.randn(most, in_features, generator=g)
    alone = torch.cat([f(x[i: i + 1]) for i in range(most)])
    exact = F.linear(x.double(), w.double(), b.double() if b is not None else None)
    assert ((alone.double() - exact).abs() <= float32_bound(x, w, b)).all()
    for rows in range(1, most + 1):
        for start in range(most - rows + 1):
            assert torch.equal(f(x[start: start + rows]), alone[start: start + rows]), (rows, start)


@needs_mkl
@pytest.mark.skipif(P.skinny_kernel() != "avx512", reason="the skinny product's AVX2 tiles run natively here, or none")
def test_avx2_tiles_pass_the_same_tests_under_aten_cpu_capability_avx2():
    """ATEN_CPU_CAPABILITY=avx2 gives an AVX-512 machine an AVX2-only CPU's tiles: float64 bounds, row independence."""
    env = {"ATEN_CPU_CAPABILITY": "avx2"}
    probe = run_tool([sys.executable, "-c", "from fairseq_stream.ops import product as p; "
                                            "print(p.skinny_kernel(), p.skinny_rows())"], env=env)
    assert probe.stdout.split() == ["avx2", str(P.skinny_rows())]
    proc = run_tool([sys.executable, "-m", "pytest", __file__, "-q", "-n", "0", "-k",
                     "equals_float64 or same_bits_whatever_shares"], env=env)
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-1000:]


def test_torch_where_it_does_not_apply():
    w, b = torch.randn(8, 4), torch.randn(8)
    for f in (P.linear(w.double(), b.double()), P.linear(w, b, "plain"), P.linear(w.half(), None)):
        assert isinstance(f, P.TorchLinear)
    x = torch.randn(3, 4, dtype=torch.float64)
    assert torch.equal(P.linear(w.double(), b.double())(x), F.linear(x, w.double(), b.double()))


@needs_mkl
def test_lean_runner_prepacks_float32_cpu_products_only(loaded, exact):
    from fairseq_stream.runners.lean import LeanRunner

    models, _ = loaded("transformer")
    lean = LeanRunner(models).lean[0]
    products = [lean.output] + [getattr(l, n) for l in lean.layers
                                for n in ("qkv", "self_out", "cross_q", "cross_kv", "cross_out", "fc1", "fc2")]
    assert all(not isinstance(p, P.TorchLinear) for p in products)
    assert isinstance(LeanRunner(models, prepack=False).lean[0].output, P.TorchLinear)
    models64, _ = exact("transformer")
    assert isinstance(LeanRunner(models64).lean[0].output, P.TorchLinear)
