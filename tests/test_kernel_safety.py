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
from fairseq_stream.ops.product import linear
from fairseq_stream.ops import rnn_step
from fairseq_stream.ops.output_layer import compiled_module

EXT = compiled_module("cpu")
pytestmark = pytest.mark.skipif(EXT is None or not hasattr(EXT, "Product"),
                                reason="the compiled CPU extension is not built")
INF, NAN = math.inf, math.nan


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
    y = linear(w, b, "int8w8", "onednn")(x)
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


# -- arguments of the wrong size ------------------------------------------------------------------------------------


def selection_inputs(S=3, k=2, W=8):
    g = torch.Generator().manual_seed(S)
    return dict(cand=torch.randn(S, W, generator=g), done_len=torch.zeros(S, k, dtype=torch.long),
                best_finished=torch.full((S,), -INF), max_lens=torch.full((S,), 10, dtype=torch.long),
                empty=torch.zeros(S, dtype=torch.bool), ids=torch.arange(S), scores=torch.zeros(S * k, 4))


def fairseq_select(i, k=2):
    return EXT.fairseq_select(i["cand"], None, None, 4, k, 2, 0, i["done_len"], i["best_finished"], i["max_lens"],
                              i["empty"], i["ids"], -1.0, -1.0, -1.0, -1)


def stay_select(i, k=2):
    return EXT.stay_select(i["cand"], None, None, 4, k, 2, 1, 0, i["done_len"], i["scores"], i["empty"], i["ids"],
                           -1.0, -1.0, -1.0, -1)


@pytest.mark.parametrize("name", ["best_finished", "max_lens", "empty", "ids"])
def test_fairseq_select_refuses_per_sentence_tensors_shorter_than_the_sentences(name):
    i = selection_inputs()
    fairseq_select(i)  # as given: fine
    i[name] = i[name][:-1]
    with pytest.raises(RuntimeError, match="fairseq_select: {} must be a \\(3,\\)".format(name)):
        fairseq_select(i)


@pytest.mark.parametrize("name", ["empty", "ids"])
def test_stay_select_refuses_per_sentence_tensors_shorter_than_the_sentences(name):
    i = selection_inputs()
    stay_select(i)
    i[name] = i[name][:-1]
    with pytest.raises(RuntimeError, match="stay_select: {} must be a \\(3,\\)".format(name)):
        stay_select(i)


def test_reorder_beam_refuses_a_negative_step():
    tokens, scores = torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 3)
    args = (torch.tensor([1, 0]), torch.tensor([True, True]), torch.tensor([5, 6]), torch.tensor([0.5, 0.25]))
    with pytest.raises(RuntimeError, match="reorder_beam_: step -1 outside the histories"):
        EXT.reorder_beam_(tokens, scores, *args, -1)
    EXT.reorder_beam_(tokens, scores, *args, 0)
    assert tokens[:, 1].tolist() == [5, 6]


def test_sentence_attention_refuses_zero_heads():
    with pytest.raises(RuntimeError, match="sentence_attention: heads must be at least 1, got 0"):
        EXT.sentence_attention(torch.zeros(4, 24), [0, 4], 0, 1.0, 100)


def test_a_cache_slot_copied_onto_itself_is_left_as_it_is():
    cache = torch.randn(2, 3, 2, 4, 5)
    before = cache.clone()
    EXT.copy_cache_slots_(cache, torch.tensor([1, 0]), torch.tensor([1, 2]), 3)
    assert torch.equal(cache[:, 1], before[:, 1]) and torch.equal(cache[:, 2, :, :3], before[:, 0, :, :3])


def test_quantized_products_refuse_a_bias_or_scales_of_the_wrong_size():
    g = torch.Generator().manual_seed(2)
    w, b, x = torch.randn(20, 64, generator=g), torch.randn(20, generator=g), torch.randn(3, 64, generator=g)
    p = Q.pack_int8(w, b)
    kernel = Q.kernel("int8w8")
    packed = Q.packed_for(p, kernel)
    with pytest.raises(RuntimeError, match="int8_linear: bias must be a \\(20,\\) float32"):
        EXT.int8_linear(x, packed, p.weight_inv, p.excess, b[:7], kernel, 127)
    with pytest.raises(RuntimeError, match="the packed weight has 2 panels of 16 outputs for 40 scales"):
        EXT.int8_linear(x, packed, torch.ones(40), torch.zeros(40, dtype=torch.int32), None, kernel, 127)
    p16 = L.pack(w, b)
    with pytest.raises(RuntimeError, match="int16_linear: bias must be a \\(20,\\) float32"):
        EXT.int16_linear(x, p16.packed, p16.weight_inv, p16.a_max, b[:7], "auto")
    if Q.onednn_exact():
        kn = Q.int8_weight(p).t().contiguous()
        q = EXT.Product(None, b[:7], "int8", packed=packed, weight_inv=p.weight_inv, excess=p.excess, in_features=64,
                        out_features=20, kernel="onednn", weight_kn=kn)
        with pytest.raises(RuntimeError, match="int8_linear: bias must be a \\(20,\\) float32"):
            q(x)


def test_int8_refuses_more_input_features_than_int32_sums_hold():
    k = Q.INT8_MAX_IN_FEATURES + 1
    quads = -(-k // 4)
    packed = torch.zeros(1, quads, 64, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="int8_linear: 66312 input features could overflow int32 sums"):
        EXT.int8_linear(torch.ones(1, k), packed, torch.ones(3), torch.zeros(3, dtype=torch.int32), None, "auto", 127)


# A decoder of one layer (width 8, 2 heads of 4), products of plain weights: enough for the compiled loops.
D, HEADS, HEAD_DIM, VOCAB = 8, 2, 4, 12


def tiny_decoder(heads=HEADS, head_dim=HEAD_DIM, positions=40):
    g = torch.Generator().manual_seed(7)

    def product(out, into=D):
        return EXT.Product(torch.randn(out, into, generator=g) * 0.3, torch.randn(out, generator=g) * 0.1)

    norm = (torch.ones(D), torch.zeros(D), 1e-5)
    layer = EXT.LeanLayer(True, [product(3 * D), product(D), product(D), product(D), product(16), product(D, 16)],
                          [norm, norm, norm], 0.5, 0.5, 0)
    embed = torch.randn(VOCAB, D, generator=g)
    return EXT.LeanDecoderModel(embed, 1.0, torch.randn(positions, D, generator=g), None, None, [layer], norm, None,
                                product(VOCAB), 1, heads, head_dim)


def encoder(sentences=1, source=5):
    g = torch.Generator().manual_seed(8)
    return [torch.randn(sentences, HEADS, source, HEAD_DIM, generator=g)], [torch.randn(sentences, HEADS, source,
                                                                                        HEAD_DIM, generator=g)]


def greedy(model, bos=2, max_len=4, min_len=0, keys=None, values=None):
    if keys is None:
        keys, values = encoder()
    return EXT.greedy_decode([model], [keys], [values], [None], bos, [max_len], min_len, 1, 2, -1, 0.0, 1.0)


def test_the_compiled_loops_decode_the_tiny_decoder():
    words, sums, lengths = greedy(tiny_decoder())
    assert 1 <= lengths.item() <= 5 and torch.isfinite(sums).all()
    words, sums, lengths, counts, steps = EXT.beam_decode([tiny_decoder()], [encoder()[0]], [encoder()[1]], [None],
                                                          2, 4, 2, [4], 0, 1, 2, -1, 0.0, 1.0)
    assert counts.item() >= 1


def test_the_compiled_loops_refuse_a_start_token_outside_the_embedding():
    with pytest.raises(RuntimeError, match="token 40 outside the embedding \\(12 rows\\)"):
        greedy(tiny_decoder(), bos=40)


def test_the_compiled_loops_refuse_positions_past_the_position_table():
    with pytest.raises(RuntimeError, match="position 3 outside the position table \\(3 rows\\)"):
        greedy(tiny_decoder(positions=3), max_len=10, min_len=5)  # no EOS before step 5


def test_the_compiled_loops_refuse_heads_that_do_not_divide_the_width():
    with pytest.raises(RuntimeError, match="\\(1, 12\\) CPU rows"):  # 3 heads of 4 against a width of 8
        greedy(tiny_decoder(heads=3))


def test_the_compiled_loops_refuse_encoder_tables_of_fewer_sentences_or_layers():
    keys, values = encoder(sentences=1)
    with pytest.raises(RuntimeError, match="sentence out of range"):
        EXT.greedy_decode([tiny_decoder()], [keys], [values], [None], 2, [4, 4], 0, 1, 2, -1, 0.0, 1.0)
    with pytest.raises(RuntimeError, match="encoder keys and values for each of the 1 layers; got 0 and 0"):
        greedy(tiny_decoder(), keys=[], values=[])


def test_lean_layers_refuse_encoder_tables_missing_a_layer_and_starts_out_of_order():
    square = EXT.Product(torch.randn(D, D), None)
    products = [EXT.Product(torch.randn(3 * D, D), None), square, square, square,
                EXT.Product(torch.randn(16, D), None), EXT.Product(torch.randn(D, 16), None)]
    layer = EXT.LeanLayer(True, products, [(torch.ones(D), torch.zeros(D), 1e-5)] * 3, 0.5, 0.5, 0)
    layers = [layer, layer]
    keys, values = encoder()  # one layer's
    cache = torch.zeros(4, 1, HEADS, 8, HEAD_DIM)
    x = torch.randn(1, D)
    with pytest.raises(RuntimeError, match="lean_layers: encoder keys and values for each of the 2 layers; got 1"):
        EXT.lean_layers(x, layers, [cache], [None], [0], [0, 1], [keys], [values], [None], [torch.tensor([0])])
    with pytest.raises(RuntimeError, match="lean_layers: starts must run in order from 0 to the 1 rows"):
        EXT.lean_layers(x, layers, [cache], [None], [0], [0, 2], [keys * 2], [values * 2], [None],
                        [torch.tensor([0])])
    with pytest.raises(RuntimeError, match="lean_window_layers: encoder keys and values for each of the 2 layers"):
        EXT.lean_window_layers(x, layers, cache, torch.tensor([0]), torch.tensor([0]), keys, values, None)
    out = EXT.lean_layers(x, layers, [cache], [None], [0], [0, 1], [keys * 2], [values * 2], [None],
                          [torch.tensor([0])])
    assert out.shape == (1, D) and torch.isfinite(out).all()
