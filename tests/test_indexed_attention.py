"""The static step's attention on CUDA (``csrc/cuda/indexed_attention_cuda.cu``) against its torch form.

Without a GPU the kernel is compiled against the host emulation of
``csrc/cuda_emu`` (blocks of 256 threads as fibers) and run on the inputs of
every attention call of a real decode: the 2-member toy ensemble stacked at
fixed k=5 and the toy transformer at greedy, on the static-slot runner's
torch path with the buckets graphs use; each call's answer must equal the
torch form's within rounding (1e-5 in float32, 1e-12 in float64). Cases the
toy does not reach (positions past one block of threads, strided queries, a
row with no visible position) are checked on random inputs. On a GPU (marked
``cuda``) the built op itself is compared the same way.
"""

import ctypes
import math

import pytest
import torch

from conftest import CSRC, cuda_emulation_library, decode, decoder_options, pointers, sorted_batches
from fairseq_stream.decoder import BeamDecoder
from fairseq_stream.ops import indexed_attention
from fairseq_stream.runners import build_runner, static_attention

SOURCES = [CSRC / "cuda" / "indexed_attention_cuda.cu", CSRC / "cuda" / "indexed_attention_cuda.h",
           CSRC / "cuda" / "accumulate.h", CSRC / "cuda" / "words.h", CSRC / "cuda_emu" / "cuda_runtime.h",
           CSRC / "cuda_emu" / "emulate_indexed_attention.cpp"]
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12}


@pytest.fixture(scope="session")
def emulation():
    """The kernel's host build, via ctypes."""
    return cuda_emulation_library("cuda-emu-indexed-attention", "emulate_indexed_attention.cpp", SOURCES, "c++17")


def emulated(lib, q, keys, values, index, mask=None, lengths=None, scale=1.0):
    """:func:`indexed_attention.indexed_attention` through the emulated kernel (the binding's checks aside)."""
    q = q if q.stride(-1) == 1 else q.contiguous()
    slots, H, T, hd = keys.shape
    mask = None if mask is None else mask.reshape(slots, T).to(q.dtype).contiguous()
    out = q.new_empty(q.size(0), H * hd)
    dims = (ctypes.c_long * 5)(q.stride(0), q.size(0), H, T, hd)
    inputs = [q, keys.contiguous(), values.contiguous(), index.contiguous(), mask,
              None if lengths is None else lengths.contiguous()]
    rc = lib.fs_emulate_indexed_attention(int(q.dtype == torch.float64), dims, ctypes.c_double(scale),
                                          pointers(inputs), ctypes.c_void_p(out.data_ptr()))
    assert rc == 0
    return out


def assert_close(ours, ref, dtype):
    both = torch.isnan(ours) & torch.isnan(ref)
    assert torch.equal(torch.isnan(ours), torch.isnan(ref))
    assert torch.allclose(ours.masked_fill(both, 0), ref.masked_fill(both, 0), rtol=0, atol=TOLERANCE[dtype])


def random_case(dtype, rows=12, slots=5, heads=4, T=37, hd=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads * hd, generator=g, dtype=dtype)
    keys = torch.randn(slots, heads, T, hd, generator=g, dtype=dtype)
    values = torch.randn(slots, heads, T, hd, generator=g, dtype=dtype)
    index = torch.randint(0, slots, (rows,), generator=g)
    return q, keys, values, index


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_an_encoder_mask_by_slot(emulation, dtype):
    q, keys, values, index = random_case(dtype)
    lengths = torch.tensor([37, 30, 12, 1, 25])  # each slot's source length: padding masked with -inf
    mask = torch.zeros(5, 1, 1, 37, dtype=dtype).masked_fill(
        torch.arange(37).view(1, 1, 1, 37) >= lengths.view(5, 1, 1, 1), -math.inf)
    ref = indexed_attention.reference(q, keys, values, index, mask, None, 0.25)
    assert_close(emulated(emulation, q, keys, values, index, mask, None, 0.25), ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_positions_past_one_block_with_lengths_and_strided_queries(emulation, dtype):
    """600 positions (three chunks of the block's 256 threads: the running softmax carries across them)."""
    fused, keys, values, index = random_case(dtype, rows=9, heads=2, T=600, hd=64)
    fused = torch.cat([fused, torch.randn_like(fused), torch.randn_like(fused)], dim=1)
    q = fused[:, 2 * 64:4 * 64]  # a view of a fused projection: rows 6 * 64 apart
    lengths = torch.tensor([0, 1, 255, 256, 257, 511, 599, 700, 300])  # past T: every position
    ref = indexed_attention.reference(q, keys, values, index, None, lengths, 0.125)
    assert_close(emulated(emulation, q, keys, values, index, None, lengths, 0.125), ref, dtype)


# head_dim: 16 and 64 (4 and 16 groups of threads for the values, keys in 16-byte words), 48 (5 groups, 16 threads
# idle), 256 (one group), 5 (keys read one entry at a time: 20 bytes a row in float32, 40 in float64).
@pytest.mark.parametrize("hd", [16, 48, 64, 256, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_head_dim_shape_of_the_value_groups(emulation, dtype, hd):
    q, keys, values, index = random_case(dtype, rows=4, slots=3, heads=2, T=300, hd=hd, seed=hd)
    lengths = torch.tensor([299, 3, 256, 40])
    ref = indexed_attention.reference(q, keys, values, index, None, lengths, hd ** -0.5)
    assert_close(emulated(emulation, q, keys, values, index, None, lengths, hd ** -0.5), ref, dtype)


def test_a_row_with_no_visible_position_is_nan_as_torch(emulation):
    q, keys, values, index = random_case(torch.float32, rows=3, slots=2, T=8)
    mask = torch.zeros(2, 8)
    mask[1] = -math.inf
    index = torch.tensor([0, 1, 0])
    out = emulated(emulation, q, keys, values, index, mask)
    assert torch.isnan(out[1]).all() and not torch.isnan(out[[0, 2]]).any()
    assert_close(out, indexed_attention.reference(q, keys, values, index, mask), torch.float32)


def recorded_attention_calls(loaded, monkeypatch, model, search):
    """Every attention call of a static-slot decode on its torch path (the buckets graphs use): the inputs, as
    the CUDA kernel would receive them, and the torch form's answer."""
    calls = []
    self_attention, source_attention = static_attention.self_attention, static_attention.source_attention

    def recording_self(q, k, v, keys, values, slot, length, positions, scale, compiled):
        out = self_attention(q, k, v, keys, values, slot, length, positions, scale, compiled)
        # After the torch form wrote this step's keys and values: the state the kernel attends over.
        calls.append((q.clone(), keys.clone(), values.clone(), slot.clone(), None, length.clone(), scale, out))
        return out

    def recording_source(q, keys, values, mask, scale, sentence, compiled):
        out = source_attention(q, keys, values, mask, scale, sentence, compiled)
        calls.append((q.clone(), keys, values, sentence.clone(), mask, None, scale, out))
        return out

    monkeypatch.setattr(static_attention, "self_attention", recording_self)
    monkeypatch.setattr(static_attention, "source_attention", recording_source)
    models, task = loaded(model)
    runner = build_runner("static", models, keep_fairseq=False)
    runner.compiled_attention = False
    runner.default_buckets()
    # A batch of 6 sentences, up to 6 tokens: the emulation runs a block's 256 threads as fibers, one block per
    # row and head, so a larger decode costs CI minutes for the same paths.
    dec = BeamDecoder(models, task.target_dictionary, runner=runner, keep_reference=False, max_len_b=6,
                      **decoder_options(search))
    out = decode(dec, models, sorted_batches(task, 6, 6), None)
    assert len(out) == 6
    return calls


# The ensemble stacked (its members' heads side by side in one pool) at fixed k=5; one model at greedy.
@pytest.mark.parametrize("model, search", [("ensemble", "fixed"), ("transformer", "greedy")])
def test_the_emulated_kernel_on_every_attention_call_of_a_static_decode(loaded, monkeypatch, emulation, model,
                                                                        search):
    calls = recorded_attention_calls(loaded, monkeypatch, model, search)
    assert len(calls) >= 20 and {c[5] is None for c in calls} == {True, False}  # both attentions, every step
    for q, keys, values, index, mask, lengths, scale, ref in calls:
        assert_close(emulated(emulation, q, keys, values, index, mask, lengths, scale), ref, q.dtype)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_the_cuda_op_equals_the_torch_form(dtype):
    assert indexed_attention.available(torch.zeros(1, 64, device="cuda"), torch.zeros(1, 1, 1, 64, device="cuda")), \
        "the CUDA indexed attention is not built"
    q, keys, values, index = [t.cuda() for t in random_case(torch.float64, rows=40, heads=8, T=300, hd=64)]
    q, keys, values = q.to(dtype), keys.to(dtype), values.to(dtype)
    lengths = torch.randint(0, 300, (40,), device="cuda")
    ours = indexed_attention.indexed_attention(q, keys, values, index, None, lengths, 0.125)
    ref = indexed_attention.reference(q.double(), keys.double(), values.double(), index, None, lengths, 0.125)
    assert torch.allclose(ours.double(), ref, rtol=0, atol={torch.float16: 2e-3}.get(dtype, TOLERANCE.get(dtype)))
