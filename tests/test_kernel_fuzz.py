"""Random shapes through every compiled kernel op, each against its reference: the quantized products bit for bit
(on every kernel this CPU runs, with rows the integers cannot hold among the ordinary ones), the attentions,
the prepacked product and the fused output layer within their tests' tolerances.

Shapes are drawn from a seeded generator: ``FAIRSEQ_STREAM_FUZZ_SHAPES`` an op (default 25, a few seconds).
``scripts/sanitize_kernels.sh`` runs this file with many more under AddressSanitizer and UBSan, where a read or
write past a tensor's end, or undefined behaviour, stops the run.
"""

import math
import os
import random

import pytest
import torch

from fairseq_stream.ops import attention as A
from fairseq_stream.ops import int16_linear as L
from fairseq_stream.ops import product as P
from fairseq_stream.ops import quantized_linear as Q
from fairseq_stream.ops import topk_log_softmax
from fairseq_stream.ops.output_layer import compiled_module
from test_kernel_safety import same_bits_or_nan
from test_output_layer import EOS, PAD, UNK, assert_matches, every_rule, random_logits

EXT = compiled_module("cpu")
pytestmark = pytest.mark.skipif(EXT is None or not hasattr(EXT, "Product"),
                                reason="the compiled CPU extension is not built")
SHAPES = int(os.environ.get("FAIRSEQ_STREAM_FUZZ_SHAPES", "25"))
ATTENTION_TOLERANCE = {torch.float32: 2e-5, torch.float64: 1e-12}


def shapes(seed):
    """SHAPES random generators, one a shape: (python's random for sizes, torch's for values)."""
    for i in range(SHAPES):
        yield i, random.Random(seed * 1_000_003 + i), torch.Generator().manual_seed(seed * 1_000_003 + i)


def rows_with_specials(rows, k, r, g):
    """Gaussian rows at a random scale, some of them holding a NaN, an infinity or only subnormal values."""
    x = torch.randn(rows, k, generator=g) * 10 ** r.uniform(-3, 3)
    for m in range(rows):
        kind = r.random()
        if kind < 0.05:
            x[m, r.randrange(k)] = math.nan
        elif kind < 0.1:
            x[m, r.randrange(k)] = r.choice([math.inf, -math.inf])
        elif kind < 0.13:
            x[m] = torch.sign(x[m]) * 1e-40
        elif kind < 0.16:
            x[m] = 0.0
    return x


def test_int8_products_on_random_shapes():
    for i, r, g in shapes(8):
        rows, k, out, bits = r.randint(1, 30), r.randint(1, 300), r.randint(1, 300), r.choice((7, 8))
        x = rows_with_specials(rows, k, r, g)
        w = torch.randn(out, k, generator=g)
        b = torch.randn(out, generator=g) if r.random() < 0.5 else None
        p = Q.pack_int8(w, b, bits)
        want = Q.reference_int8(x, p)
        for kernel in Q.kernels("int8w{}".format(bits)):
            y = EXT.int8_linear(x, Q.packed_for(p, kernel), p.weight_inv, p.excess, p.bias, kernel, p.weight_max)
            same_bits_or_nan(y, want, (i, rows, k, out, bits, kernel))


@pytest.mark.skipif(not Q.onednn_exact(), reason="oneDNN's int8 GEMM is not exact (or not used) on this CPU")
def test_onednn_int8_products_on_random_shapes():
    for i, r, g in shapes(9):
        rows, k, out = r.randint(1, 80), r.randint(1, 600), r.randint(1, 200)
        x = rows_with_specials(rows, k, r, g)
        w, b = torch.randn(out, k, generator=g), torch.randn(out, generator=g)
        same_bits_or_nan(P.linear(w, b, "int8w8", "onednn")(x), Q.reference_int8(x, Q.pack_int8(w, b)),
                         (i, rows, k, out))


def test_int16_products_on_random_shapes():
    for i, r, g in shapes(16):
        rows, k, out = r.randint(1, 30), r.randint(1, 300), r.randint(1, 300)
        x = rows_with_specials(rows, k, r, g)
        w = torch.randn(out, k, generator=g) * 10 ** r.uniform(-2, 2)
        p = L.pack(w, torch.randn(out, generator=g) if r.random() < 0.5 else None)
        want = L.reference(x, p)
        for kernel in L.kernels():
            same_bits_or_nan(L.int16_linear(x, p, kernel), want, (i, rows, k, out, kernel))


def close(got, want, dtype):
    assert got.shape == want.shape
    assert want.numel() == 0 or (got - want).abs().max() <= ATTENTION_TOLERANCE[dtype]


def test_cached_attention_on_random_shapes():
    for i, r, g in shapes(21):
        dtype = r.choice((torch.float32, torch.float64))
        H, hd, capacity = r.randint(1, 4), r.randint(1, 40), r.randint(1, 40)
        slots = r.randint(1, 12)
        rows = r.randint(1, slots)
        length = r.randrange(capacity)
        qkv = torch.randn(rows, 3 * H * hd, generator=g, dtype=dtype)
        q, k, v = qkv.split(H * hd, dim=1)
        cache = torch.randn(2, slots, H, capacity, hd, generator=g, dtype=dtype)
        slot = torch.randperm(slots, generator=g)[:rows] if r.random() < 0.5 else None
        ours, ref = cache.clone(), cache.clone()
        got = A.cached_attention_(q, k, v, ours[0], ours[1], slot, length, 0.3)
        want = A.cached_attention_(q, k, v, ref[0], ref[1], slot, length, 0.3, compiled=False)
        assert torch.equal(ours, ref)
        close(got, want, dtype)


def source_inputs(r, g, dtype):
    """Encoder keys and values of random sizes, a padding mask (each sentence keeps a position), row sentences."""
    S, H, T, hd = r.randint(1, 6), r.randint(1, 4), r.randint(1, 30), r.randint(1, 40)
    keys = torch.randn(S, H, T, hd, generator=g, dtype=dtype)
    values = torch.randn(S, H, T, hd, generator=g, dtype=dtype)
    mask = None
    if r.random() < 0.7:
        mask = torch.zeros(S, 1, 1, T, dtype=dtype)
        for s in range(S):
            left, right = r.randrange(T), r.randrange(T)
            keep = r.randrange(T)
            mask[s, ..., :left] = -math.inf
            mask[s, ..., T - right:] = -math.inf
            mask[s, ..., keep] = 0.0
    row_sentence = torch.randint(0, S, (r.randint(1, 20),), generator=g)
    return keys, values, mask, row_sentence


def test_source_attention_on_random_shapes():
    for i, r, g in shapes(22):
        dtype = r.choice((torch.float32, torch.float64))
        keys, values, mask, row_sentence = source_inputs(r, g, dtype)
        _, H, _, hd = keys.shape
        q = torch.randn(row_sentence.numel(), 2 * H * hd, generator=g, dtype=dtype)[:, :H * hd]  # strided rows
        got = A.source_attention(q, keys, values, mask, 0.3, row_sentence)
        close(got, A.source_attention(q, keys, values, mask, 0.3, row_sentence, compiled=False), dtype)


def test_window_attention_on_random_shapes():
    for i, r, g in shapes(23):
        dtype = r.choice((torch.float32, torch.float64))
        rows, H, hd, capacity = r.randint(1, 5), r.randint(1, 4), r.randint(1, 32), r.randint(2, 30)
        # Each row's window: consecutive positions from a start, within the capacity.
        window_row, window_step = [], []
        for row in range(rows):
            start = r.randrange(capacity)
            width = r.randint(1, capacity - start)
            window_row += [row] * width
            window_step += list(range(start, start + width))
        N = len(window_row)
        window_row, window_step = torch.tensor(window_row), torch.tensor(window_step)
        qkv = torch.randn(N, 3 * H * hd, generator=g, dtype=dtype)
        q, k, v = qkv.split(H * hd, dim=1)
        cache = torch.randn(2, rows, H, capacity, hd, generator=g, dtype=dtype)
        ours, ref = cache.clone(), cache.clone()
        needed = int(window_step.max()) + 1
        got = A.window_attention_(q, k, v, ours[0], ours[1], window_row, window_step, needed, 0.3)
        want = A.window_attention_(q, k, v, ref[0], ref[1], window_row, window_step, needed, 0.3, compiled=False)
        assert torch.equal(ours, ref)
        close(got, want, dtype)


def sentence_attention_reference(qkv, starts, heads, scale):
    """Each token over its own sentence's tokens, in torch."""
    N, width = qkv.shape
    D = width // 3
    out = qkv.new_zeros(N, D)
    for a, b in zip(starts[:-1], starts[1:]):
        if a == b:
            continue
        q, k, v = (qkv[a:b, i * D:(i + 1) * D].reshape(b - a, heads, D // heads).transpose(0, 1) for i in range(3))
        weights = torch.softmax((q * scale) @ k.transpose(1, 2), dim=-1)
        out[a:b] = (weights @ v).transpose(0, 1).reshape(b - a, D)
    return out


def test_sentence_attention_on_random_shapes():
    for i, r, g in shapes(24):
        dtype = r.choice((torch.float32, torch.float64))
        heads, hd = r.randint(1, 4), r.randint(1, 24)
        lengths = [r.randint(0, 20) for _ in range(r.randint(1, 5))]
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        qkv = torch.randn(starts[-1], 3 * heads * hd, generator=g, dtype=dtype)
        dense_from = r.randint(1, 25)
        got = EXT.sentence_attention(qkv, starts, heads, 0.3, dense_from)
        close(got, sentence_attention_reference(qkv, starts, heads, 0.3), dtype)


def test_prepacked_products_on_random_shapes():
    if not P.available():
        pytest.skip("MKL's packed sgemm is not in this torch build")
    for i, r, g in shapes(25):
        out, k = r.randint(1, 300), r.randint(1, 300)
        w = torch.randn(out, k, generator=g)
        b = torch.randn(out, generator=g) if r.random() < 0.5 else None
        x = torch.randn(r.choice((1, 2, 3, 4, 5, r.randint(6, 70))), k, generator=g)
        want = torch.nn.functional.linear(x.double(), w.double(), b.double() if b is not None else None)
        for gemm in ("mkl",) + (("onednn",) if not P.onednn_missing_reason() else ()):
            product = P.linear(w, b, kernel=gemm)
            for got in (product(x), product.gemm_product(x)):
                assert (got.double() - want).abs().max() <= 1e-4 * (1 + want.abs().max())


def test_output_layer_on_random_shapes():
    for i, r, g in shapes(26):
        dtype = r.choice((torch.float32, torch.float64))
        rows, V = r.randint(1, 20), r.randint(4, 3000)
        n = r.randint(1, min(V, 200))
        members = [random_logits(g, rows, V, dtype) for _ in range(r.choice((1, 1, 2)))]
        logits = members[0] if len(members) == 1 else members
        kw = every_rule(g, rows, dtype, "cpu") if r.random() < 0.5 else dict(pad=PAD, eos=EOS, unk=UNK)
        assert_matches(topk_log_softmax(logits, n, backend="cpu", **kw), logits, n, **kw)
