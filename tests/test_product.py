"""The one product op: one bound type for every precision, made in one place, the same object for Python and for
the compiled steps (issue 51, item 4). The kernels' bits are the kernel tests' (test_prepacked_linear.py,
test_quantized_linear.py, test_int16_linear.py); here, that every caller gets the one type."""

import pytest
import torch

from fairseq_stream.ops import int16_linear, product, quantized_linear
from fairseq_stream.ops.loader import compiled_module

EXT = compiled_module("cpu")
pytestmark = pytest.mark.skipif(EXT is None or not hasattr(EXT, "Product"), reason="the compiled CPU extension is not built")


@pytest.mark.parametrize("precision, bound", [("int8w8", "int8"), ("int8w7", "int8"), ("int8", "int8"),
                                              ("int16", "int16")])
def test_each_quantized_precision_is_the_one_bound_type(precision, bound):
    g = torch.Generator().manual_seed(3)
    w, b, x = torch.randn(40, 24, generator=g), torch.randn(40, generator=g), torch.randn(7, 24, generator=g)
    p = product.linear(w, b, precision)
    assert type(p) is EXT.Product and p.precision == bound and (p.in_features, p.out_features) == (24, 40)
    assert p.weight is None and torch.equal(p.bias, b)
    if bound == "int16":
        want = int16_linear.reference(x, int16_linear.pack(w, b))
    else:
        want = quantized_linear.reference_int8(x, quantized_linear.pack_int8(
            w, b, quantized_linear.int8_weight_bits(precision)))
    assert torch.equal(p(x), want)
    assert torch.equal(p(x.view(7, 1, 24)), want.view(7, 1, 40))  # any leading shape


def test_float32_is_the_bound_type_where_mkl_is_found_and_plain_is_torchs():
    g = torch.Generator().manual_seed(4)
    w, b = torch.randn(30, 16, generator=g), torch.randn(30, generator=g)
    plain = product.linear(w, b, "plain")
    assert isinstance(plain, product.TorchLinear)
    compiled = product.compiled(EXT, plain)
    assert type(compiled) is EXT.Product and compiled.precision == "plain" and compiled.weight is w
    x = torch.randn(3, 16, generator=g)
    assert torch.equal(compiled(x), plain(x))
    if not product.available():
        pytest.skip("MKL's packed sgemm is not in this torch build: " + product.missing_reason())
    p = product.linear(w, b, "float32")
    assert type(p) is EXT.Product and p.precision == "float32" and p.weight is not None and p.packed is not None
    assert product.compiled(EXT, p) is p  # the compiled steps take the object Python calls


def test_the_constructor_refuses_what_a_precision_lacks():
    w = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="precision float32, int8, int16 or plain, not int4"):
        EXT.Product(w, None, "int4")
    with pytest.raises(RuntimeError, match="int8 needs its packed weight and scales"):
        EXT.Product(w, None, "int8")
    p = quantized_linear.pack_int8(w)
    with pytest.raises(RuntimeError, match="int8 needs its excess"):
        EXT.Product(None, None, "int8", packed=p.packed, weight_inv=p.weight_inv, in_features=8, out_features=4)
    with pytest.raises(RuntimeError, match="one scale per output row"):
        EXT.Product(None, None, "int8", packed=p.packed, weight_inv=p.weight_inv, excess=p.excess, in_features=8,
                    out_features=5)
    with pytest.raises(RuntimeError, match="plain needs a weight"):
        EXT.Product(None, None, "plain")
    with pytest.raises(ValueError, match="int8, int8w8, int8w7, int16"):
        product.linear(w, None, "int4")


@pytest.mark.parametrize("quantize", [None, "int8w8", "int16"])
def test_the_lean_runner_and_its_compiled_layers_hold_the_same_products(loaded, quantize):
    from fairseq_stream.runners.lean import LeanRunner

    models, _ = loaded("transformer")
    lean = LeanRunner(models, quantize=quantize).lean[0]
    products = [lean.output] + [getattr(layer, name) for layer in lean.layers
                                for name in ("qkv", "self_out", "cross_q", "cross_kv", "cross_out", "fc1", "fc2")]
    want = {None: "float32", "int8w8": "int8", "int16": "int16"}[quantize]
    if want == "float32" and not product.available():
        pytest.skip("MKL's packed sgemm is not in this torch build")
    assert all(type(p) is EXT.Product and p.precision == want for p in products)
    assert all(product.compiled(EXT, p) is p for p in products)
