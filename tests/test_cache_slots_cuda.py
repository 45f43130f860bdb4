"""The beam's slot copies on CUDA (``csrc/cuda/cache_slots_cuda.cu``) against torch's indexed assignment.

Without a GPU the kernel is compiled against the host emulation of
``csrc/cuda_emu`` and run on every copy list of real decodes: the static-slot
runner's reorders (padded lists: entries past the children copy a slot onto
itself) on the stacked 2-member toy ensemble at fixed k=5 and the lean
runner's on the toy at var-batch k=5; the cache each copy leaves must equal
torch's form's bit for bit, in the word size the binding picks for it.
Random cases add every word size, positions 0 and all, and float16. On a
GPU (marked ``cuda``) the built op itself is compared the same way.
"""

import ctypes

import pytest
import torch

from conftest import CSRC, cuda_emulation_library, decode, decoder_options, sorted_batches
from fairseq_stream.decoder import BeamDecoder
from fairseq_stream.ops import attention
from fairseq_stream.runners import build_runner, static_slots

SOURCES = [CSRC / "cuda" / "cache_slots_cuda.cu", CSRC / "cuda" / "cache_slots_cuda.h", CSRC / "cuda" / "words.h",
           CSRC / "cuda_emu" / "cuda_runtime.h", CSRC / "cuda_emu" / "emulate_cache_slots.cpp"]


@pytest.fixture(scope="session")
def emulation():
    """The kernel's host build, via ctypes."""
    return cuda_emulation_library("cuda-emu-cache-slots", "emulate_cache_slots.cpp", SOURCES, "c++17")


def word_bytes(cache):
    """The binding's choice (cache_slots_cuda_binding.cpp): the widest word dividing a position's bytes and the
    cache's address."""
    unit, word = cache.size(4) * cache.element_size(), 16
    while word > 1 and (unit % word or cache.data_ptr() % word):
        word //= 2
    return word


def emulated(lib, cache, source, target, length, word=None):
    """``attention.copy_slots_`` through the emulated kernel, in place on a contiguous CPU ``cache``."""
    assert cache.is_contiguous()
    word = word or word_bytes(cache)
    position = cache.size(4) * cache.element_size()
    assert position % word == 0
    outer, slots, heads, capacity, _ = cache.shape
    source, target = source.contiguous(), target.contiguous()
    dims = (ctypes.c_long * 6)(source.numel(), outer, slots, heads, capacity * position // word,
                               length * position // word)
    rc = lib.fs_emulate_copy_cache_slots(word, dims, ctypes.c_void_p(cache.data_ptr()),
                                         ctypes.c_void_p(source.data_ptr()), ctypes.c_void_p(target.data_ptr()))
    assert rc == 0


def torch_form(cache, source, target, length):
    cache[:, target, :, :length] = cache[:, source, :, :length]


def same_bits(a, b):
    """Whether two caches hold the same bits: positions no row wrote may hold any bits (a NaN among them makes
    torch.equal false on equal tensors)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                                                      b.contiguous().view(torch.uint8))


def random_cache(dtype, outer=4, slots=9, heads=3, capacity=11, hd=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(outer, slots, heads, capacity, hd, generator=g, dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("dtype, hd, word", [(torch.float32, 8, 16), (torch.float32, 8, 8), (torch.float32, 3, 4),
                                             (torch.float16, 8, 16), (torch.float16, 3, 2), (torch.float64, 2, 16),
                                             (torch.uint8, 5, 1)])
@pytest.mark.parametrize("length", [0, 1, 7, 11])
def test_a_padded_copy_list_in_every_word_size(emulation, dtype, hd, word, length):
    cache = random_cache(dtype, hd=hd) if dtype.is_floating_point else torch.randint(
        0, 255, (4, 9, 3, 11, hd), generator=torch.Generator().manual_seed(1), dtype=dtype)
    # Children of slots 1 and 4 into free slots 6, 2, 8; then two padded entries (slot 1 onto itself).
    source, target = torch.tensor([1, 4, 1, 1, 1]), torch.tensor([6, 2, 8, 1, 1])
    ours, ref = cache.clone(), cache.clone()
    emulated(emulation, ours, source, target, length, word)
    torch_form(ref, source, target, length)
    assert same_bits(ours, ref)  # positions past length and the other slots untouched too


def test_no_entries_and_a_single_head(emulation):
    cache = random_cache(torch.float32, outer=2, heads=1)
    ours = cache.clone()
    emulated(emulation, ours, torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), 5)
    assert same_bits(ours, cache)
    emulated(emulation, ours, torch.tensor([3]), torch.tensor([0]), 5)
    torch_form(cache, torch.tensor([3]), torch.tensor([0]), 5)
    assert same_bits(ours, cache)


def test_more_pieces_than_blocks_along_y(emulation):
    """12 layers' keys and values x 4 heads = 48 pieces an entry over 16 blocks: each block takes several."""
    cache = random_cache(torch.float32, outer=12, slots=5, heads=4, capacity=6, hd=4)
    ours, ref = cache.clone(), cache.clone()
    source, target = torch.tensor([0, 3]), torch.tensor([4, 1])
    emulated(emulation, ours, source, target, 6)
    torch_form(ref, source, target, 6)
    assert same_bits(ours, ref)


def recorded_copies(loaded, monkeypatch, runner_name, model, search):
    """Every slot copy of a real decode on the CPU: (the cache before it, source, target, length)."""
    calls = []
    if runner_name == "static":
        copy = static_slots.copy_slots

        def recording(caches, source, target, positions, compiled=True):
            calls.extend((c.clone(), source.clone(), target.clone(), positions) for c in caches)
            copy(caches, source, target, positions, compiled)

        monkeypatch.setattr(static_slots, "copy_slots", recording)
    else:
        copy = attention.copy_slots_

        def recording(cache, source, target, length):
            calls.append((cache.clone(), source.clone(), target.clone(), int(length)))
            copy(cache, source, target, length)

        monkeypatch.setattr(attention, "copy_slots_", recording)
    models, task = loaded(model)
    runner = build_runner(runner_name, models, keep_fairseq=False)
    if runner_name == "static":
        runner.default_buckets()  # as CUDA runs it: the padded copy lists of a graph's buckets
    else:
        runner.sync_free = True  # as CUDA runs it: padded copy lists, nothing read back
    dec = BeamDecoder(models, task.target_dictionary, runner=runner, keep_reference=False, max_len_b=8,
                      **decoder_options(search))
    dec.compiled_loop = False  # the reorders through the runner, as on CUDA
    out = decode(dec, models, sorted_batches(task, 8, 8), None)
    assert len(out) == 8
    return calls


@pytest.mark.parametrize("runner_name, model, search", [("static", "ensemble", "fixed"),
                                                        ("lean", "transformer", "var-batch")])
def test_the_emulated_kernel_on_every_copy_of_a_decode(loaded, monkeypatch, emulation, runner_name, model, search):
    calls = recorded_copies(loaded, monkeypatch, runner_name, model, search)
    padded = sum(int(source.eq(target).sum()) for _, source, target, _ in calls)
    assert len(calls) >= 5 and any(length > 1 for *_, length in calls)
    if runner_name == "static":
        assert padded > 0  # the fixed-length lists' self-copies, which the kernel skips
    for cache, source, target, length in calls:
        ours, ref = cache.clone(), cache.clone()
        emulated(emulation, ours, source, target, length)
        torch_form(ref, source, target, length)
        assert same_bits(ours, ref)


def test_the_static_runner_copies_the_written_positions_by_a_compiled_copy(loaded, monkeypatch):
    """With a compiled copy the reorder copies the positions written, not the length bucket (16); torch's form,
    whose ATen shapes a trace compares, keeps the bucket."""
    seen = {}
    copy = static_slots.copy_slots

    def recording(caches, source, target, positions, compiled=True):
        seen.setdefault(compiled, set()).add(positions)
        copy(caches, source, target, positions, compiled)

    monkeypatch.setattr(static_slots, "copy_slots", recording)
    models, task = loaded("transformer")
    for compiled_attention in (True, False):
        runner = build_runner("static", models, keep_fairseq=False)
        runner.compiled_attention = compiled_attention
        runner.default_buckets()
        dec = BeamDecoder(models, task.target_dictionary, runner=runner, keep_reference=False, max_len_b=8,
                          **decoder_options("fixed"))
        dec.compiled_loop = False
        decode(dec, models, sorted_batches(task, 4, 4), None)
    if attention.copies_slots_in_place(runner.pool.caches[0]):
        assert max(seen[True]) < 16 and len(seen[True]) > 1
    assert seen[False] == {16}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype, hd", [(torch.float16, 64), (torch.float32, 64), (torch.float64, 3),
                                       (torch.float16, 3)])
def test_the_cuda_op_equals_the_torch_form(dtype, hd):
    cache = random_cache(dtype, outer=12, slots=40, heads=16, capacity=48, hd=hd).cuda()
    assert attention.copies_slots_in_place(cache), "the CUDA cache slot copy is not built"
    source = torch.tensor([1, 1, 5, 7, 7, 7, 1, 1], device="cuda")
    target = torch.tensor([20, 21, 22, 23, 24, 25, 1, 1], device="cuda")
    for length in (0, 1, 30, 48):
        ours, ref = cache.clone(), cache.clone()
        attention.copy_slots_(ours, source, target, length)
        torch_form(ref, source, target, length)
        assert same_bits(ours, ref)
