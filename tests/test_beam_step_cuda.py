"""The CUDA search step (``csrc/cuda/beam_step_cuda.cu``) against the torch reference.

Without a GPU, the kernels are compiled against the host emulation of
``csrc/cuda_emu`` (blocks of 256 threads as fibers) and stand in for
``beam_step.fairseq_select`` and ``stay_select`` on every step of real
decoding on the CPU: the toy models, both finalization rules, each pruning
heuristic, both kinds of candidates (whole-vocabulary ones and the fused
layer's pre-selected ones), streaming cohorts, float32 and float64. Each
step's answer must equal the torch code of
:func:`fairseq_stream.search.selection.fairseq_step` and ``stay_step`` bit
for bit. The
binding's part (``at::topk`` over the candidates, the allocations) is done here
in torch, as the binding does it in ATen. On a GPU (marked ``cuda``) the built
op itself decodes on CUDA tensors under the same comparison.
"""

import copy
import ctypes

import pytest
import torch

from fairseq import utils

from conftest import CSRC, cuda_emulation_library, decode, pointers, sorted_batches
from fairseq_stream.decoder import BeamDecoder
from fairseq_stream.ops import beam_step
from fairseq_stream.search import policies, selection
from fairseq_stream.search.pruning import Pruning
# Both rules, each heuristic; checked_steps: every step compiled and in torch, which must agree.
from test_beam_step import SEARCHES, assert_same_step, checked_steps  # noqa: F401 (a fixture)

SOURCES = [CSRC / "beam_select_row.h", CSRC / "cuda" / "beam_step_cuda.cu", CSRC / "cuda" / "beam_step_cuda.h",
           CSRC / "cuda_emu" / "cuda_runtime.h", CSRC / "cuda_emu" / "emulate_beam_step.cpp"]

@pytest.fixture(scope="session")
def emulation():
    """The kernel's host build, via ctypes."""
    return cuda_emulation_library("cuda-emu-beam-step", "emulate_beam_step.cpp", SOURCES, "c++17")


def emulated_select(lib, cand, local, word_of, per_slot, k, eos, step, done_len, best_finished, max_lens, empty,
                    ids, pruning):
    """``beam_step.fairseq_select`` through the emulated kernel: the binding's steps, in torch."""
    S, W = cand.shape
    n = min(2 * k, W - (0 if word_of is not None else 1))
    top_scores, top_idx = torch.topk(cand, n, dim=1)
    dtype, long, flag = cand.dtype, torch.long, torch.bool
    out = [torch.empty(S, k, dtype=long), torch.empty(S, k, dtype=long), torch.empty(S, k, dtype=dtype),
           torch.empty(S, k, dtype=flag), torch.empty(S, k, dtype=flag), torch.empty(S, k, dtype=long),
           torch.empty(S, k, dtype=dtype), torch.empty(S, k, dtype=long), torch.empty(S, dtype=dtype),
           torch.empty(S, dtype=flag), torch.zeros(3 * S + 1, dtype=long), torch.empty(S * k, dtype=long),
           torch.empty(S, dtype=flag)]
    rp, ap, rpl, mc = beam_step._pruning(pruning)
    inputs = [top_scores.contiguous(), top_idx.contiguous(), None if word_of is None else word_of.contiguous(),
              None if local is None else local.contiguous(), done_len.contiguous(), best_finished.contiguous(),
              max_lens.contiguous(), empty.contiguous(), ids.contiguous()]
    dims = (ctypes.c_long * 9)(S, n, k, per_slot, eos, step, W if word_of is not None else 0,
                               W if local is not None else 0, mc)
    rc = lib.fs_emulate_fairseq_select(int(dtype == torch.float64), dims, (ctypes.c_double * 3)(rp, ap, rpl),
                                       pointers(inputs), pointers(out))
    assert rc == 0
    return out + [torch.zeros(S, k, dtype=flag)]


def emulated_stay(lib, cand, local, word_of, per_slot, k, eos, pad, step, done_len, scores, empty, ids, pruning):
    """``beam_step.stay_select`` through the emulated kernels: the finished entries' scores (a kernel), at::topk
    over them and the expansions (here in torch), the step (a kernel)."""
    S, W = cand.shape
    dtype, long, flag = cand.dtype, torch.long, torch.bool
    out = [torch.empty(S, k, dtype=long), torch.empty(S, k, dtype=long), torch.empty(S, k, dtype=dtype),
           torch.empty(S, k, dtype=flag), torch.empty(S, k, dtype=flag), torch.empty(S, k, dtype=flag),
           torch.empty(S, dtype=flag), torch.empty(S, k, dtype=long), torch.empty(S, dtype=flag),
           torch.zeros(2 * S + 1, dtype=long), torch.empty(S * k, dtype=long), torch.empty(S * k, dtype=flag)]
    done_scores = torch.empty(S, k, dtype=dtype)
    rp, ap, rpl, mc = beam_step._pruning(pruning)
    history = scores.contiguous()
    dims = (ctypes.c_long * 9)(S, k, W, per_slot, eos, pad, step, mc, history.size(1))
    inputs = [None, None, None if word_of is None else word_of.contiguous(),
              None if local is None else local.contiguous(), done_len.contiguous(), empty.contiguous(),
              ids.contiguous(), history]
    call = lambda: lib.fs_emulate_stay_select(int(dtype == torch.float64), dims, (ctypes.c_double * 3)(  # noqa: E731
        rp, ap, rpl), pointers(inputs), pointers(out + [done_scores]))
    assert call() == 0
    top_scores, top_idx = torch.topk(torch.cat([cand, done_scores], dim=1), k, dim=1)
    inputs[:2] = [top_scores.contiguous(), top_idx.contiguous()]
    assert call() == 0
    return out


@pytest.fixture
def emulated(emulation, monkeypatch):
    """beam_step's two selections through the emulated kernels."""
    monkeypatch.setattr(beam_step, "fairseq_select", lambda *a: emulated_select(emulation, *a))
    monkeypatch.setattr(beam_step, "stay_select", lambda *a: emulated_stay(emulation, *a))


@pytest.mark.parametrize("model", ["transformer", "lstm"])
@pytest.mark.parametrize("output_layer", ["torch", "fused"])
@pytest.mark.parametrize("search", sorted(SEARCHES))
def test_the_emulated_kernels_equal_the_reference_on_every_step(loaded, emulated, checked_steps, model,
                                                                output_layer, search):
    models, task = loaded(model)
    # max_len_b 12: some sentences end at their maximum length, others by k finalized hypotheses.
    dec = BeamDecoder(models, task.target_dictionary, output_layer=output_layer, keep_reference=False,
                      max_len_b=12, **SEARCHES[search])
    out = decode(dec, models, sorted_batches(task, 6, 40), None)
    assert len(out) == 37 and checked_steps[0] > 20


@pytest.mark.parametrize("search", ["fixed", "var-batch"])
def test_the_emulated_kernels_in_float64(exact, emulated, checked_steps, search):
    models, task = exact("transformer")
    dec = BeamDecoder(models, task.target_dictionary, keep_reference=False, max_len_b=12, **SEARCHES[search])
    out = decode(dec, models, sorted_batches(task, 8, 40), None)
    assert len(out) == 37 and checked_steps[0] > 20


def test_the_emulated_stay_rule_under_streaming(loaded, emulated, checked_steps):
    """Cohorts that split and join (a capacity in rows): done lengths and histories travel with them."""
    models, task = loaded("transformer")
    dec = BeamDecoder(models, task.target_dictionary, keep_reference=False, **SEARCHES["var-batch"])
    out = decode(dec, models, sorted_batches(task, 6, 40), dict(pool_size=12, eps=1 / 6, order="shortest", capacity=9))
    assert len(out) == 37 and checked_steps[0] > 20


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_emulated_kernels_past_one_block_of_threads(emulated, dtype):
    """600 sentences: three blocks of 256 threads, the last one partly idle; ties and -inf among the candidates,
    sentences at their maximum length, empty ones, finalized entries already held."""
    g = torch.Generator().manual_seed(0)
    S, k, vocab = 600, 4, 10
    cand = torch.randint(-6, 0, (S, k * vocab), generator=g).to(dtype)  # integers: many ties
    cand[torch.rand(S, k * vocab, generator=g) < 0.2] = -float("inf")
    done_len = torch.randint(0, 2, (S, k), generator=g) * 3
    args = (cand, cand - 1, k, vocab, 2, Pruning(), 3, done_len.sort(dim=1, descending=True).values,
            torch.full((S,), -float("inf"), dtype=dtype), torch.randint(2, 9, (S,), generator=g),
            torch.rand(S, generator=g) < 0.05, torch.arange(S))
    assert_same_step(selection.fairseq_step(*args, compiled=True), selection.fairseq_step(*args, compiled=False))
    # The stay rule over the same candidates, with finished entries of lengths 1-3 in a history of width 4.
    scores = torch.randint(-9, 0, (S * k, 4), generator=g).to(dtype)
    stay = (cand, cand - 1, k, vocab, 2, 1, Pruning(), 3, done_len.sort(dim=1, descending=True).values, scores,
            torch.rand(S, generator=g) < 0.05, torch.arange(S))
    assert_same_step(selection.stay_step(*stay, compiled=True), selection.stay_step(*stay, compiled=False))


def reorder_case(rows, dtype, seed=0):
    """Histories wider than the step (rows of 12 tokens and 11 scores at step 5), parents repeated and skipped."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 100, (rows, 12), generator=g), torch.randn(rows, 11, generator=g, dtype=dtype),
            torch.randint(0, rows, (rows,), generator=g), torch.rand(rows, generator=g) > 0.3,
            torch.randint(0, 100, (rows,), generator=g), torch.randn(rows, generator=g, dtype=dtype), 5)


def torch_reorder(tokens, scores, parent, extended, new_token, new_score, step):
    """The torch code of beam_step.reorder_beam_, on copies."""
    tokens, scores = tokens.clone(), scores.clone()
    tokens[:, : step + 1] = tokens[:, : step + 1].index_select(0, parent)
    scores[:, :step] = scores[:, :step].index_select(0, parent)
    tokens[:, step + 1] = torch.where(extended, new_token, tokens[:, step + 1])
    scores[:, step] = torch.where(extended, new_score, scores[:, step])
    return tokens, scores


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_emulated_reorder_moves_the_histories_as_the_torch_code(emulation, dtype):
    """600 rows: three blocks of threads, every row read before any is written."""
    tokens, scores, parent, extended, new_token, new_score, step = reorder_case(600, dtype)
    expected = torch_reorder(tokens, scores, parent, extended, new_token, new_score, step)
    dims = (ctypes.c_long * 4)(600, step, tokens.stride(0), scores.stride(0))
    rc = emulation.fs_emulate_reorder_beam(int(dtype == torch.float64), dims, ctypes.c_void_p(tokens.data_ptr()),
                                           ctypes.c_void_p(scores.data_ptr()),
                                           pointers([parent, extended, new_token, new_score]))
    assert rc == 0 and torch.equal(tokens, expected[0]) and torch.equal(scores, expected[1])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_reorder_moves_the_histories_as_the_torch_code(dtype):
    case = [t.cuda() if isinstance(t, torch.Tensor) else t for t in reorder_case(600, dtype)]
    expected = torch_reorder(*case)
    beam_step.reorder_beam_(*case)
    assert torch.equal(case[0], expected[0]) and torch.equal(case[1], expected[1])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("search", sorted(SEARCHES))
def test_cuda_op_equals_the_reference_on_every_step(loaded, checked_steps, search):
    models, task = loaded("transformer")
    assert beam_step.select_available(torch.zeros(1, 2, device="cuda")), "the CUDA search step is not built"
    # Copies: the session's cached models stay on the CPU for the tests after this one.
    models = [copy.deepcopy(m).cuda() for m in models]
    dec = BeamDecoder(models, task.target_dictionary, keep_reference=False, max_len_b=12, **SEARCHES[search])
    out = decode(dec, models, [utils.move_to_cuda(s) for s in sorted_batches(task, 6, 40)], None)
    assert len(out) == 37 and checked_steps[0] > 20
