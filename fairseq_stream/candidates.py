"""A step's candidates: from the models' output to each sentence's candidate scores, before the search picks.

The decoder's model call (:meth:`fairseq_stream.decoder.BeamDecoder.call_model`) asks
:func:`candidates` (decoder, cohort, output) for ``(cand, local, word_of,
per_slot)``: each sentence's candidate scores (sentences, slots x per_slot),
their single-word log-probabilities and the word of each candidate (None:
its index mod V). Two paths give the same candidates:

* the reference: the ensemble's log-probabilities with fairseq's rules
  applied (:func:`constrain`), then each row's best;
* the fused output layer: the decoder's ``top_candidates`` over each
  model's logits (bias, log-softmax, rules and top-n in one kernel call).

What it reads of the decoder: ``beam_size``, ``vocab_size``, ``dense``,
``fused``, ``candidates_per_row``, ``shortest_max_len``, ``min_len``, the
special symbols, ``unk_penalty``, ``score_dtype``, ``repeat_ngram_blocker``
and ``top_candidates``. Functions of the decoder, not an object holding it:
``BeamDecoder.with_lengths`` copies a decoder with other length rules, and
the copy's rules must be the ones read.
"""

import math
from typing import List, Optional

import torch
from torch import Tensor

from fairseq_stream.cohort import Cohort
from fairseq_stream.ops import topk_log_softmax
from fairseq_stream.ops.output_layer import OutputLayerResult, apply_step_rules


def per_row(k: int, vocab_size: int, finalize: str, pruning_active: bool) -> int:
    """How many candidates each decoder row contributes to its sentence's selection (fused layer).

    A sentence's best k (``stay``) or 2k (``fairseq``) candidates are among
    its rows' best k (2k). Greedy (k = 1, no pruning) needs only the best:
    if it ends in EOS the sentence has its one hypothesis and ends, else it
    is the next token.
    """
    if finalize == "stay":
        return min(k, vocab_size)
    if k == 1 and not pruning_active:
        return 1
    return min(2 * k, vocab_size)


def candidates(d, c: Cohort, lprobs):
    """(cand, local, word_of, per_slot) of ``c``'s step from the decoder's output for its run rows."""
    k, V, S, step = d.beam_size, d.vocab_size, c.size, c.step
    if d.fused:
        return fused_candidates(d, c, lprobs)
    lprobs = constrain(d, c, lprobs)
    if step == 0 and d.dense:
        # All slots hold the same start: extend slot 0 only (as fairseq).
        cand = nan_to_neg_inf_(lprobs.view(S, k, V)[:, 0, :])
        return cand, cand, None, V
    if d.dense:
        # In place: nothing reads the log-probabilities of single words
        # here (dense means no pruning heuristic, the only reader).
        cand = nan_to_neg_inf_(lprobs.add_(c.scores[:, step - 1: step]).view(S, k * V))
        return cand, cand, None, V
    # Each row's best candidates first: a sentence's best k (2k for
    # fairseq's rule) are among its rows' best k (2k), so selection
    # then works on (sentences, k x n) instead of x V. Each row goes
    # to its own slot (empty slots hold -inf), so that a candidate's
    # slot is its index // n and no count of live rows is read back.
    n = d.candidates_per_row
    row_scores = lprobs + c.scores[c.run_rows, step - 1: step] if step > 0 else lprobs
    top_scores, top_words = torch.topk(nan_to_neg_inf_(row_scores), k=n, dim=1)
    top_local = nan_to_neg_inf_(lprobs.gather(1, top_words))
    cand, local, word_of = by_slot(k, S, c.run_rows, top_scores, top_local, top_words)
    return cand, local, word_of, n


def fused_candidates(d, c: Cohort, logits: List[Tensor]):
    """:func:`candidates` from the models' logits by the fused output layer.

    The same candidates as the reference path (each row's best n by
    cumulative score, in one (S, k x n) layout with -inf for rows not run),
    but the log-softmax, the rules and the top-n are one kernel call over
    the logits, and only (rows, n) values come back.
    """
    k, S, step, n = d.beam_size, c.size, c.step, d.candidates_per_row
    rows = c.run_rows
    if step == 0 and d.dense:
        # All slots hold the same start: extend slot 0 only (as fairseq).
        logits = [x[::k] for x in logits]
        rows = rows[::k]
    force_eos = None
    if step >= d.shortest_max_len:
        force_eos = c.max_lens.le(step).index_select(0, rows // k)
    # The arguments are the decoder's own and keep their kinds from step to step.
    out = d.top_candidates(logits, n, ban_eos=step < d.min_len, force_eos=force_eos, check=step == 0)
    top_local = out.values
    if step == 0 and d.dense and n >= d.vocab_size:
        # Every word of slot 0: fairseq's first step takes the best V - 1 (a beam of V - 1 then takes the
        # last one even if it is an EOS), so none of the other slots' -inf may stand in for them.
        m = d.vocab_size - 1
        return top_local[:, :m], top_local[:, :m], out.indices[:, :m], m
    if d.dense and step > 0:  # every slot is a run row, in order: a slice, not a gather
        top_scores = top_local + c.scores[:, step - 1 : step]
        return top_scores.view(S, k * n), top_local.view(S, k * n), out.indices.view(S, k * n), n
    top_scores = top_local + c.scores[rows, step - 1 : step] if step > 0 else top_local
    return (*by_slot(k, S, rows, top_scores, top_local, out.indices), n)


def by_slot(k: int, S: int, rows: Tensor, top_scores: Tensor, top_local: Tensor, top_words: Tensor):
    """Each run row's n candidates moved to its beam slot: (cand, local, word_of), each (S, k x n).

    Slots not run hold -inf candidates, so that a candidate's slot is its
    index // n and no count of live rows is read back.
    """
    n = top_scores.size(1)
    cand = top_scores.new_full((S * k, n), -math.inf).index_copy_(0, rows, top_scores)
    local = top_local.new_zeros((S * k, n)).index_copy_(0, rows, top_local)
    word_of = top_words.new_zeros((S * k, n)).index_copy_(0, rows, top_words)
    return cand.view(S, k * n), local.view(S, k * n), word_of.view(S, k * n)


def constrain(d, c: Cohort, lprobs: Tensor) -> Tensor:
    """``lprobs`` in the score type with fairseq's rules applied (pad, --unkpen, lengths, n-grams).

    NaNs are left for the caller, which turns them into -inf on the
    candidates it builds anyway (one pass over the vocabulary fewer).
    """
    step = c.step
    at_max = None
    if step >= d.shortest_max_len:
        # Sentences at their maximum length may only end.
        at_max = c.max_lens.le(step).index_select(0, c.run_rows // d.beam_size)
    lprobs = apply_step_rules(lprobs.to(d.score_dtype), d.pad, d.eos, d.unk, d.unk_penalty, at_max,
                              step < d.min_len)
    if d.repeat_ngram_blocker is not None:
        rows = c.run_rows.numel()
        lprobs = d.repeat_ngram_blocker(c.tokens[c.run_rows], lprobs, rows, 1, step)
    return lprobs


def nan_to_neg_inf_(t: Tensor) -> Tensor:
    """``t`` with NaN replaced by -inf, in place (as fairseq's ``lprobs[lprobs != lprobs]``, without its sync)."""
    return t.nan_to_num_(nan=-math.inf, posinf=math.inf, neginf=-math.inf)


def top_candidates(d, logits, n: int, ban_eos=None, force_eos: Optional[Tensor] = None,
                   check: bool = True) -> OutputLayerResult:
    """Each row's ``n`` best words and their log-probabilities from the models' ``logits``: the fused layer.

    fairseq's step rules with the decoder's settings (PAD never chosen,
    ``--unkpen``, ``--temperature``), EOS banned where ``ban_eos`` (True or a
    row mask: below ``--min-len``) and forced where ``force_eos`` (a row
    mask: at the maximum length), on the decoder's output backend;
    ``check``: validate the arguments (see
    :func:`~fairseq_stream.ops.topk_log_softmax`). Jacobi's windows use it to
    keep greedy's rules.
    """
    return topk_log_softmax(logits, n, pad=d.pad, eos=d.eos, unk=d.unk, unk_penalty=d.unk_penalty,
                            temperature=d.temperature, ban_eos=ban_eos, force_eos=force_eos,
                            backend=d.output_backend, check=check)

