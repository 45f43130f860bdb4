"""The compiled attentions of the lean runner's step against their torch references.

Real decoding with them is covered by tests/test_lean_runner.py (float64 n-best
lists equal the fairseq runner's, the kernels included) and the float32
comparisons there and in tests/test_jacobi.py.
"""

import math

import pytest
import torch

from fairseq_stream.ops import attention as A

needs_kernel = pytest.mark.skipif(not A.compiled_applies(torch.zeros(1)),
                                  reason="the compiled CPU extension is not built")
TOLERANCE = {torch.float32: 2e-5, torch.float64: 1e-12}


def projection(rows, dim, dtype, g):
    """q, k, v as the runner has them: strided views of one fused projection."""
    qkv = torch.randn(rows, 3 * dim, generator=g, dtype=dtype)
    return qkv.split(dim, dim=-1)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows, slots, length, with_slots", [
    (1, 1, 0, False), (5, 5, 7, False), (20, 24, 30, False), (3, 8, 4, True), (17, 40, 12, True), (6, 6, 31, True),
])
def test_cached_attention_writes_and_attends_as_the_reference(dtype, rows, slots, length, with_slots):
    g = torch.Generator().manual_seed(rows * 100 + length)
    H, hd, capacity = 4, 16, 32
    q, k, v = projection(rows, H * hd, dtype, g)
    cache = torch.randn(2, slots, H, capacity, hd, generator=g, dtype=dtype)
    slot = torch.randperm(slots, generator=g)[:rows] if with_slots else None
    ours_cache, ref_cache = cache.clone(), cache.clone()
    ours = A.cached_attention_(q, k, v, ours_cache[0], ours_cache[1], slot, length, 0.25)
    ref = A.cached_attention_(q, k, v, ref_cache[0], ref_cache[1], slot, length, 0.25, compiled=False)
    assert torch.equal(ours_cache, ref_cache)  # the same positions written with the same values
    assert ours.shape == (rows, H * hd)
    assert (ours - ref).abs().max() <= TOLERANCE[dtype]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("masked", [False, True])
def test_source_attention_as_the_reference(dtype, masked):
    g = torch.Generator().manual_seed(3)
    S, H, T, hd = 6, 4, 11, 16
    keys = torch.randn(S, H, T, hd, generator=g, dtype=dtype)
    values = torch.randn(S, H, T, hd, generator=g, dtype=dtype)
    mask = None
    if masked:  # sentence i has its last i positions padded
        mask = torch.zeros(S, 1, 1, T, dtype=dtype)
        for i in range(S):
            mask[i, ..., T - i:] = -math.inf
    # Rows of a few sentences (sentence 2 has none), a sentence's rows not all together.
    row_sentence = torch.tensor([0, 0, 1, 3, 3, 3, 4, 5, 1, 5])
    q = projection(row_sentence.numel(), H * hd, dtype, g)[0]
    ours = A.source_attention(q, keys, values, mask, 0.25, row_sentence)
    ref = A.source_attention(q, keys, values, mask, 0.25, row_sentence, compiled=False)
    assert (ours - ref).abs().max() <= TOLERANCE[dtype]
    if masked:  # padded positions get no weight: changing their values changes nothing
        values[5, :, T - 5:] = 1e6
        assert torch.equal(A.source_attention(q, keys, values, mask, 0.25, row_sentence), ours)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_source_attention_skips_padding_exactly(dtype):
    """Padding on the left (fairseq's sources) and on the right (joined batches) is skipped, not scored:
    each row's output is bitwise what the unpadded sentence alone gives, and matches the reference."""
    g = torch.Generator().manual_seed(5)
    S, H, T, hd = 4, 4, 13, 16
    keys = torch.randn(S, H, T, hd, generator=g, dtype=dtype)
    values = torch.randn(S, H, T, hd, generator=g, dtype=dtype)
    spans = [(0, T), (5, T), (2, 9), (12, 13)]  # [first, end) of each sentence's real positions
    mask = torch.full((S, 1, 1, T), -math.inf, dtype=dtype)
    for n, (a, b) in enumerate(spans):
        mask[n, ..., a:b] = 0
    row_sentence = torch.tensor([3, 1, 2, 0, 2])
    q = projection(row_sentence.numel(), H * hd, dtype, g)[0]
    ours = A.source_attention(q, keys, values, mask, 0.25, row_sentence)
    ref = A.source_attention(q, keys, values, mask, 0.25, row_sentence, compiled=False)
    assert (ours - ref).abs().max() <= TOLERANCE[dtype]
    for r, n in enumerate(row_sentence.tolist()):
        a, b = spans[n]
        alone = A.source_attention(q[r:r + 1], keys[n:n + 1, :, a:b].contiguous(),
                                   values[n:n + 1, :, a:b].contiguous(), None, 0.25, torch.tensor([0]))
        assert torch.equal(ours[r:r + 1], alone)


@needs_kernel
def test_rows_do_not_depend_on_their_call_or_threads():
    g = torch.Generator().manual_seed(4)
    H, hd, T = 4, 16, 9
    keys, values = torch.randn(2, 3, H, T, hd, generator=g).unbind(0)
    row_sentence = torch.tensor([0, 1, 2, 2, 1, 0, 2])
    q = torch.randn(7, H * hd, generator=g)
    whole = A.source_attention(q, keys, values, None, 0.3, row_sentence)
    alone = torch.cat([A.source_attention(q[i:i + 1], keys, values, None, 0.3, row_sentence[i:i + 1])
                       for i in range(7)])
    assert torch.equal(whole, alone)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(A.source_attention(q, keys, values, None, 0.3, row_sentence), whole)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_bad_arguments_are_one_line_errors():
    keys = torch.zeros(2, 4, 8, 16)
    q = torch.zeros(2, 64)
    with pytest.raises(RuntimeError, match="past the capacity"):
        A.cached_attention_(q, q, q, keys, keys.clone(), None, 8, 1.0)
    with pytest.raises(RuntimeError, match="slot out of range"):
        A.cached_attention_(q, q, q, keys, keys.clone(), torch.tensor([0, 2]), 3, 1.0)
    with pytest.raises(RuntimeError, match="sentence out of range"):
        A.source_attention(q, keys, keys.clone(), None, 1.0, torch.tensor([0, 5]))


def test_other_types_take_the_reference():
    assert not A.compiled_applies(torch.zeros(1, dtype=torch.float16))
    assert not A.compiled_applies(torch.zeros(1, dtype=torch.bfloat16))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("widths", [[1, 1, 1, 1], [3, 3, 3, 3], [2, 1, 4, 1]], ids=["one", "square", "ragged"])
def test_window_attention_writes_and_attends_as_the_reference(dtype, widths):
    g = torch.Generator().manual_seed(sum(widths))
    rows, H, hd, capacity = 4, 4, 16, 24
    starts = [0, 5, 2, 11]
    # Rows in another order than their slots, as after sentences end.
    slots = [2, 0, 3, 1]
    window_row = torch.tensor([slots[r] for r in range(rows) for _ in range(widths[r])])
    window_step = torch.tensor([starts[r] + j for r in range(rows) for j in range(widths[r])])
    q, k, v = projection(len(window_row), H * hd, dtype, g)
    cache = torch.randn(2, rows, H, capacity, hd, generator=g, dtype=dtype)
    needed = int(window_step.max()) + 1
    ours_cache, ref_cache = cache.clone(), cache.clone()
    ours = A.window_attention_(q, k, v, ours_cache[0], ours_cache[1], window_row, window_step, needed, 0.25)
    ref = A.window_attention_(q, k, v, ref_cache[0], ref_cache[1], window_row, window_step, needed, 0.25,
                              compiled=False)
    assert torch.equal(ours_cache, ref_cache)
    assert (ours - ref).abs().max() <= TOLERANCE[dtype]
    # Causal inside the window: changing each row's last window position changes no other output.
    last = torch.tensor([n + 1 == len(window_row) or bool(window_row[n + 1] != window_row[n])
                         for n in range(len(window_row))])
    k2, v2 = k.clone(), v.clone()
    k2[last] += 1.0
    v2[last] -= 1.0
    again_cache = cache.clone()
    again = A.window_attention_(q, k2, v2, again_cache[0], again_cache[1], window_row, window_step, needed, 0.25)
    assert torch.equal(again[~last], ours[~last]) and not torch.equal(again[last], ours[last])


@needs_kernel
def test_window_attention_one_line_errors():
    q = torch.zeros(2, 8)
    keys = torch.zeros(2, 2, 4, 4)
    with pytest.raises(RuntimeError, match="window row out of range"):
        A.window_attention_(q, q, q, keys, keys.clone(), torch.tensor([0, 2]), torch.tensor([0, 1]), 2, 1.0)
    with pytest.raises(RuntimeError, match="past the capacity"):
        A.window_attention_(q, q, q, keys, keys.clone(), torch.tensor([0, 1]), torch.tensor([0, 4]), 5, 1.0)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("length", [0, 1, 9, 16])
def test_copying_cache_slots_equals_torchs_indexed_assignment(dtype, length):
    g = torch.Generator().manual_seed(length)
    cache = torch.randn(6, 10, 4, 16, 8, generator=g, dtype=dtype)
    source, target = torch.tensor([0, 0, 3, 7]), torch.tensor([1, 5, 2, 9])
    ours, ref = cache.clone(), cache.clone()
    A.copy_slots_(ours, source, target, length)
    ref[:, target, :, :length] = ref[:, source, :, :length]
    assert torch.equal(ours, ref)
    with pytest.raises(RuntimeError, match="slot out of range"):
        A.copy_slots_(ours, torch.tensor([0]), torch.tensor([10]), length)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_references_without_torchs_fused_attention_as_cuda_runs_them(monkeypatch, dtype):
    """On CUDA the references take the bmm formulation at every size (``_use_sdpa``: cuDNN's plan per
    shape); here both formulations on the same inputs: the cached prefix, the encoder's (masked), Jacobi's
    window (causal)."""
    g = torch.Generator().manual_seed(7)
    H, hd, capacity, length = 4, 16, 24, 9
    rows = 5  # below BMM_ATTENTION_ROWS: the CPU takes torch's fused attention
    q, k, v = projection(rows, H * hd, dtype, g)
    cache = torch.randn(2, rows, H, capacity, hd, generator=g, dtype=dtype)
    S, T = 3, 11
    keys, values = (torch.randn(S, H, T, hd, generator=g, dtype=dtype) for _ in range(2))
    mask = torch.zeros(S, 1, 1, T, dtype=dtype)
    mask[1, ..., T - 4:] = -math.inf
    row_sentence = torch.tensor([0, 2, 1, 1, 2])
    window_row, window_step = torch.tensor([0, 0, 0, 3, 4, 4]), torch.tensor([2, 3, 4, 0, 6, 7])
    qw, kw, vw = projection(len(window_row), H * hd, dtype, g)

    def outputs():
        c = cache.clone()
        return [A.cached_attention_(q, k, v, c[0], c[1], None, length, 0.25, compiled=False),
                A.source_attention(q, keys, values, mask, 0.25, row_sentence, compiled=False),
                A.window_attention_(qw, kw, vw, c[0], c[1], window_row, window_step, 8, 0.25, compiled=False)]

    fused = outputs()
    monkeypatch.setattr(A, "_use_sdpa", lambda t, rows: False)
    for ours, theirs in zip(outputs(), fused):
        assert ours.shape == theirs.shape and torch.isfinite(ours).all()
        assert (ours - theirs).abs().max() <= TOLERANCE[dtype]


def random_parents(rows, capacity, g):
    """Each new row's parent slot as a decoder's reorder makes them: a parent may have several children,
    slots no row keeps are free."""
    old = torch.randperm(capacity, generator=g)[:rows]
    return old[torch.randint(0, rows, (rows,), generator=g).sort().values]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows, capacity, length, compact_above", [
    (1, 1, 0, 32), (5, 5, 3, 32), (5, 12, 7, 32), (10, 64, 9, 32), (40, 64, 16, 32), (3, 8, 4, 1), (8, 8, 0, 1),
])
def test_following_parents_compiled_equals_the_torch_form(dtype, rows, capacity, length, compact_above):
    """The one CPU implementation of the rows' cache move (the lean runner's reorder and the compiled search
    loop's) gives the torch form's slots and, on every slot a row reads, its caches."""
    g = torch.Generator().manual_seed(rows * 100 + capacity + length)
    for _ in range(5):
        parent = random_parents(rows, capacity, g)
        caches = [torch.randn(4, capacity, 2, 16, 8, generator=g, dtype=dtype) for _ in range(2)]
        ours, ref = [c.clone() for c in caches], [c.clone() for c in caches]
        ours, slot = A.follow_parents_(ours, parent, length, compact_above)
        ref, ref_slot = A.follow_parents_(ref, parent, length, compact_above, compiled=False)
        assert torch.equal(slot, ref_slot) and [c.shape for c in ours] == [c.shape for c in ref]
        for a, b, c in zip(ours, ref, caches):
            assert torch.equal(a[:, slot, :, :length], b[:, ref_slot, :, :length])
            assert torch.equal(a[:, slot, :, :length], c[:, parent, :, :length])


@needs_kernel
def test_following_parents_refuses_more_rows_than_slots():
    with pytest.raises(RuntimeError, match="follow_parent_slots: 3 rows in 2 slots"):
        A.follow_parents_([torch.zeros(2, 2, 1, 4, 2)], torch.tensor([0, 0, 1]), 1, 32)
