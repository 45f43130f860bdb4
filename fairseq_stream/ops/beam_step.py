"""The search step's bookkeeping as compiled CPU ops: fewer, larger calls one sentence at a time.

One sentence at a time (beam 5, one CPU thread), a search step is about 40
small torch ops whose dispatch costs more than their arithmetic: 0.37 ms of
a 0.87 ms decoder call on the Multi30k LSTM (docs/BENCHMARKS.md, issue 14).
The two ops here do the same work in one call each, in plain loops over the
step's few hundred numbers (``csrc/cpu/beam_step_cpu.cpp``):

* :func:`fairseq_select` — fairseq's finalization (``fixed``, ``greedy``,
  ``var --finalize fairseq``): the selection of
  :func:`fairseq_stream.search.selection.select_fairseq` with any pruning
  heuristics, and the bookkeeping of
  :func:`fairseq_stream.search.selection.fairseq_step` (its torch
  reference, which it equals exactly; ties among the best ``2k`` candidates
  come out in ``torch.topk``'s order because the op calls it).
* :func:`stay_select` — the streaming paper's rule (``--finalize stay``:
  ``var-batch``, ``var-stream``, ``fixed --finalize stay``):
  :func:`fairseq_stream.search.selection.select_stay` with pruning, and the
  bookkeeping of :func:`fairseq_stream.search.selection.stay_step`.
* :func:`reorder_beam_` — the move of the token and score histories to the
  next beam, in place, for any search (the torch version is its reference).

All three run on CPU tensors where the extension is built (:func:`available`).
On CUDA, :func:`fairseq_select` and :func:`stay_select` run the CUDA module's
kernels for float32 and float64 candidates (:func:`select_available`: a
thread per sentence runs the CPU op's loop body, ``csrc/beam_select_row.h``,
after ``at::topk`` on the device; the torch reference there is about 57 small
kernels a step, each launched from the host), and :func:`reorder_beam_` two
kernels for float32 and float64 histories. Elsewhere (half precision, no
build) the torch code runs, with the same results.
"""

from typing import List, Optional

import torch
from torch import Tensor

from fairseq_stream.ops.loader import compiled_module


def _extension():
    """The CPU module where it is built with these ops; None: the torch code runs instead."""
    module = compiled_module("cpu")
    return module if hasattr(module, "stay_select") else None


def available(device: torch.device) -> bool:
    """Whether the compiled ops run for tensors on ``device`` (CPU, extension built)."""
    return device.type == "cpu" and _extension() is not None


def _cuda_extension():
    """The CUDA module where it is built with the search step; None: the torch code runs on CUDA."""
    module = compiled_module("cuda")
    return module if hasattr(module, "stay_select") else None


def select_available(cand: Tensor) -> bool:
    """Whether :func:`fairseq_select` and :func:`stay_select` run compiled for candidates ``cand``: on the CPU
    as :func:`available` says, on CUDA for float32 and float64 where the CUDA module is built."""
    if cand.device.type == "cuda":
        return cand.dtype in (torch.float32, torch.float64) and _cuda_extension() is not None
    return available(cand.device)


def _module(cand: Tensor):
    return _cuda_extension() if cand.device.type == "cuda" else _extension()


def _pruning(pruning):
    """The heuristics as the ops take them: a negative value is off."""
    off = -1.0
    return (off if pruning.rp is None else float(pruning.rp), off if pruning.ap is None else float(pruning.ap),
            off if pruning.rpl is None else float(pruning.rpl), -1 if pruning.mc is None else int(pruning.mc))


def fairseq_select(cand: Tensor, local: Optional[Tensor], word_of: Optional[Tensor], per_slot: int, k: int,
                   eos: int, step: int, done_len: Tensor, best_finished: Tensor, max_lens: Tensor, empty: Tensor,
                   ids: Tensor, pruning) -> List[Tensor]:
    """The compiled :func:`~fairseq_stream.search.selection.fairseq_step`, on the CPU or CUDA
    (:func:`select_available`).

    Returns [parent, token, score, live, eos_mask, top_slot, top_score,
    done_len, best_finished, finished_now, summary, flat_parent, no_live,
    zeros] as that function's :class:`~fairseq_stream.search.selection.FairseqStep`
    and its ``Step`` name them (``no_live``: the Step's ``finished``, the
    beam holds no live hypothesis; ``zeros``: an (S, k) bool for its empty
    ``done`` and ``fresh``).
    """
    return _module(cand).fairseq_select(cand, local, word_of, per_slot, k, eos, step, done_len, best_finished,
                                        max_lens, empty, ids, *_pruning(pruning))


def stay_select(cand: Tensor, local: Optional[Tensor], word_of: Optional[Tensor], per_slot: int, k: int, eos: int,
                pad: int, step: int, done_len: Tensor, scores: Tensor, empty: Tensor, ids: Tensor,
                pruning) -> List[Tensor]:
    """The compiled :func:`~fairseq_stream.search.selection.stay_step`, on the CPU or CUDA
    (:func:`select_available`). On CUDA a finished length beyond ``scores`` (never from the decoder) reads as no
    finished entry; the CPU op refuses it (a check there would read the device).

    Returns [parent, token, score, live, done, fresh, no_live, done_len,
    finished_now, summary, flat_parent, extended] as that function's
    :class:`~fairseq_stream.search.selection.StayStep` and its ``Step`` name
    them (``no_live``: the Step's ``finished``).
    """
    return _module(cand).stay_select(cand, local, word_of, per_slot, k, eos, pad, step, done_len, scores, empty,
                                     ids, *_pruning(pruning))


def reorder_beam_(tokens: Tensor, scores: Tensor, flat_parent: Tensor, extended: Tensor, new_token: Tensor,
                  new_score: Tensor, step: int) -> None:
    """Move the histories to the next beam in place: row ``r`` takes row ``flat_parent[r]``'s.

    Tokens ``[0, step]`` and scores ``[0, step)`` are copied from the
    parent; where ``extended``, the row's token ``step + 1`` and score
    ``step`` become ``new_token`` and ``new_score``; elsewhere those columns
    keep the row's own (untouched) values.
    """
    if available(tokens.device):
        _extension().reorder_beam_(tokens, scores, flat_parent, extended, new_token, new_score, step)
        return
    if (tokens.device.type == "cuda" and select_available(scores) and tokens.stride(1) == 1
            and scores.stride(1) == 1):
        _cuda_extension().reorder_beam_(tokens, scores, flat_parent, extended, new_token, new_score, step)
        return
    tokens[:, : step + 1] = tokens[:, : step + 1].index_select(0, flat_parent)
    scores[:, :step] = scores[:, :step].index_select(0, flat_parent)
    tokens[:, step + 1] = torch.where(extended, new_token, tokens[:, step + 1])
    scores[:, step] = torch.where(extended, new_score, scores[:, step])
