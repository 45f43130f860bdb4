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


