"""The two finalization rules as pure functions on batched candidate scores.

Both take the candidates of ``S`` sentences with beam width ``k`` over a
vocabulary of ``V`` words: ``cand[s, j * V + w]`` is the cumulative
log-probability of extending slot ``j`` of sentence ``s`` with word ``w``
(-inf where slot ``j`` is not live). They return a :class:`Step`: for each new
slot, the slot it continues and the word it adds.

* :func:`select_fairseq` — fairseq's SequenceGenerator: of the best ``2k``
  candidates, those ending in EOS among the best ``k`` are finalized at once;
  the next beam is the best ``k`` not ending in EOS.
* :func:`select_stay` — Yang et al. (2020), App. A.1: finished candidates stay
  on the beam and compete with new expansions; the sentence ends when no live
  candidate is left on its beam.

Pruning (:class:`~fairseq_stream.search.pruning.Pruning`) is applied after the
reduction to ``k``, as in Freitag & Al-Onaizan (2017).

With ``word_of`` given, candidates are not the whole vocabulary per slot but
``vocab`` pre-selected ones: ``cand[s, j * vocab + i]`` extends slot ``j``
with the word ``word_of[s, j * vocab + i]``.
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from fairseq_stream.ops import beam_step
from fairseq_stream.search.pruning import Pruning


@dataclass
class Step:
    """The outcome of one selection; all (S, k) unless noted.

    Nothing in it has been read back to the host: a selection is a few tensor
    operations with no host synchronization, whatever it finalizes.
    """

    parent: Tensor  # slot each new slot continues (or keeps, for carried finished ones)
    token: Tensor  # word it adds (pad for carried finished ones)
    score: Tensor  # its cumulative log-probability
    live: Tensor  # bool: an unfinished hypothesis to extend next step
    done: Tensor  # bool: a finished hypothesis on the beam (stay)
    fresh: Tensor  # bool: done, and finished at this very step (stay)
    finished: Tensor  # (S,) bool: the sentence ends now
    # fairseq: the best k candidates by rank, and which of them to finalize.
    eos_mask: Optional[Tensor] = None  # bool: the candidate of this rank ends in EOS and is finalized
    top_slot: Optional[Tensor] = None  # the slot the candidate of this rank extends
    top_score: Optional[Tensor] = None  # its cumulative score

    # The finalized hypotheses as flat lists (fairseq). Each reads the mask
    # back to the host (a sync): for inspection and tests, not the decoder.

    @property
    def eos_sentence(self) -> Tensor:
        """(n,) sentence of each hypothesis to finalize, in (sentence, rank) order."""
        return self.eos_mask.nonzero(as_tuple=True)[0]

    @property
    def eos_slot(self) -> Tensor:
        """(n,) the slot each one extends."""
        return self.top_slot[self.eos_mask]

    @property
    def eos_score(self) -> Tensor:
        """(n,) its cumulative score."""
        return self.top_score[self.eos_mask]


def _words(top_idx, vocab, word_of):
    return top_idx % vocab if word_of is None else word_of.gather(1, top_idx)


def select_fairseq(cand, local, k, vocab, eos, pruning: Pruning, best_finished=None, word_of=None, ignore=None):
    """fairseq's rule; ``finished`` only reports sentences whose beam emptied by pruning.

    The caller counts finalized hypotheses (a sentence with ``k`` of them, or
    at its maximum length, also ends). ``ignore``: (S, k) bool, fairseq's
    ``cands_to_ignore`` (:func:`forced_eos_ranks`), or None.
    """
    S = cand.size(0)
    # fairseq's bound (size - 1) on whole-vocabulary candidates; pre-selected ones are all usable.
    n = min(2 * k, cand.size(1) - (1 if word_of is None else 0))
    top_scores, top_idx = torch.topk(cand, k=n, dim=1)
    beams, words = top_idx // vocab, _words(top_idx, vocab, word_of)
    is_eos = words.eq(eos) & torch.isfinite(top_scores)
    keep = pruning.keep(
        top_scores, local.gather(1, top_idx), beams, torch.zeros_like(is_eos), best_finished
    )
    # Finalized: the EOS candidates among the best k that survive pruning.
    # Kept as an (S, k) mask: listing them would read it back to the host.
    eos_mask = (is_eos & keep)[:, :k]
    if ignore is not None:
        # As fairseq: a rank to ignore is neither finalized nor kept (unless the beam must take it).
        eos_mask = eos_mask & ~ignore
        is_eos = is_eos.clone()
        is_eos[:, :k] |= ignore

    # The best k candidates that do not end in EOS (fairseq's active_mask trick).
    order_key = is_eos.long() * n + torch.arange(n, device=cand.device)
    pick = torch.topk(order_key, k=k, dim=1, largest=False).indices
    live = keep.gather(1, pick) & ~is_eos.gather(1, pick)
    none = torch.zeros_like(live)
    return Step(
        parent=beams.gather(1, pick),
        token=words.gather(1, pick),
        score=top_scores.gather(1, pick),
        live=live,
        done=none,
        fresh=none,
        finished=~live.any(dim=1),
        eos_mask=eos_mask,
        top_slot=beams[:, :k],
        top_score=top_scores[:, :k],
    )


@dataclass
class FairseqStep:
    """A step of fairseq's rule with its bookkeeping (:func:`fairseq_step`); per sentence unless noted."""

    sel: Step
    n_final: Tensor  # (S,) hypotheses finalized now
    done_len: Tensor  # (S, k) the lengths of the finalized hypotheses, in order (0: none yet)
    best_finished: Tensor  # (S,) the best finalized cumulative score so far
    finished_now: Tensor  # (S,) bool: the sentence ends now (empty sources included)
    # (3S + 1,) int64, the host's one read: finished_now + 2 * empty, ids,
    # n_final, and the live rows left in the sentences that go on
    summary: Tensor
    flat_parent: Tensor  # (S * k,) the row each new row continues

    @property
    def extended(self) -> Tensor:
        """(S * k,) bool: the row adds a token this step; under fairseq's rule, the live ones."""
        return self.sel.live.view(-1)


def forced_eos_ranks(last_token: Tensor, last_score: Tensor, eos: int) -> Tensor:
    """fairseq's ``cands_to_ignore`` for a step, from the beam's last tokens and scores (S, k).

    A beam wider than the words that are not EOS (``--min-len 0`` and k = V - 1 at step 0) must take an
    EOS candidate, which fairseq both finalizes and keeps on the beam, in its last slots; at the next
    step it then ignores the candidates of those ranks. Only a forced EOS puts a finite EOS on the beam
    (an ignored rank the beam must take in turn, which needs every slot's EOS among the best 2k, is not
    seen here).
    """
    return last_token.eq(eos) & torch.isfinite(last_score)


def fairseq_step(cand, local, k, vocab, eos, pruning: Pruning, step, done_len, best_finished, max_lens, empty,
                 ids, word_of=None, compiled: Optional[bool] = None, ignore: Optional[Tensor] = None) -> FairseqStep:
    """:func:`select_fairseq` and what the decoder tracks after it, as one step.

    ``done_len`` counts the finalized hypotheses (slot j holds the length of
    the sentence's j-th, 0: none yet), so that a sentence with k of them is
    known to end without a look at the host's lists. A sentence ends with k
    finalized, at its maximum length (``max_lens`` <= ``step``), with an
    empty beam (pruning), or at once for an empty source.

    ``compiled`` (default: where the extension is built, on the CPU, and on
    CUDA for float32 and float64 candidates) runs the op of
    :mod:`fairseq_stream.ops.beam_step`, one call instead of about 40 torch
    ops, with identical results; not with ``ignore`` (:func:`select_fairseq`),
    which the op does not take.
    """
    if compiled is None:
        compiled = beam_step.select_available(cand) and ignore is None
    if compiled:
        (parent, token, score, live, eos_mask, top_slot, top_score, new_done_len, best, finished_now,
         summary, flat_parent, no_live, none) = beam_step.fairseq_select(
            cand, local, word_of, vocab, k, eos, step, done_len, best_finished, max_lens, empty, ids, pruning)
        sel = Step(parent=parent, token=token, score=score, live=live, done=none, fresh=none,
                   finished=no_live, eos_mask=eos_mask, top_slot=top_slot, top_score=top_score)
        S = cand.size(0)
        return FairseqStep(sel, summary[2 * S : 3 * S], new_done_len, best, finished_now, summary, flat_parent)

    S = cand.size(0)
    sel = select_fairseq(cand, local, k, vocab, eos, pruning, best_finished, word_of, ignore)
    n_final = sel.eos_mask.sum(dim=1)
    had = done_len.gt(0).sum(dim=1, keepdim=True)
    now = (had + n_final.unsqueeze(1)).clamp(max=k)
    slot = torch.arange(k, device=cand.device)
    new_done_len = done_len.masked_fill(slot.ge(had) & slot.lt(now), step + 1)
    finished = sel.finished | now.squeeze(1).ge(k) | max_lens.le(step)
    best = sel.top_score.masked_fill(~sel.eos_mask, -math.inf).amax(dim=1)
    best_finished = torch.maximum(best_finished, best.to(best_finished.dtype))
    finished_now = finished | empty
    live_left = (sel.live & ~finished_now.unsqueeze(1)).sum().view(1)
    summary = torch.cat([finished_now.long() + empty.long() * 2, ids.long(), n_final, live_left])
    flat_parent = (sel.parent + torch.arange(S, device=cand.device).unsqueeze(1) * k).view(-1)
    return FairseqStep(sel, n_final, new_done_len, best_finished, finished_now, summary, flat_parent)


def select_stay(cand, local, done_scores, k, vocab, eos, pad, pruning: Pruning, word_of=None):
    """The streaming paper's rule.

    Args:
        done_scores: (S, k) cumulative score of each finished slot on the
            beam, -inf for slots that are not finished.
    """
    S = cand.size(0)
    pool = torch.cat([cand, done_scores], dim=1)
    pool_local = torch.cat([local, torch.zeros_like(done_scores)], dim=1)
    width = min(k, pool.size(1))
    top_scores, top_idx = torch.topk(pool, k=width, dim=1)
    if width < k:  # tiny vocabularies: pad the beam with empty slots
        top_scores = torch.cat([top_scores, top_scores.new_full((S, k - width), -math.inf)], dim=1)
        top_idx = torch.cat([top_idx, top_idx.new_zeros((S, k - width))], dim=1)
    n_expansions = cand.size(1)
    carried = top_idx >= n_expansions
    beams = torch.where(carried, top_idx - n_expansions, top_idx // vocab)
    expansion = top_idx.clamp(max=n_expansions - 1)
    words = torch.where(carried, torch.full_like(top_idx, pad), _words(expansion, vocab, word_of))
    keep = pruning.keep(top_scores, pool_local.gather(1, top_idx), beams, carried)
    fresh = keep & ~carried & words.eq(eos)
    done = keep & carried | fresh
    live = keep & ~carried & ~fresh
    # The beam is done when it holds no live candidate: finished entries stay
    # (their score is the reference for --prune-ap, App. A.3) until live ones
    # finish or fall below them.
    return Step(
        parent=beams,
        token=words,
        score=top_scores,
        live=live,
        done=done,
        fresh=fresh,
        finished=~live.any(dim=1),
    )


@dataclass
class StayStep:
    """A step of the streaming paper's rule with its bookkeeping (:func:`stay_step`)."""

    sel: Step
    done_len: Tensor  # (S, k) the length of each finished entry on the beam (0: not finished)
    finished_now: Tensor  # (S,) bool: the sentence ends now (empty sources included)
    # (2S + 1,) int64, the host's one read: finished_now + 2 * empty, ids, and
    # the live rows left in the sentences that go on
    summary: Tensor
    flat_parent: Tensor  # (S * k,) the row each new row continues
    extended: Tensor  # (S * k,) bool: the row adds a token this step (live or just finished)


def done_scores(done_len: Tensor, scores: Tensor, S: int, k: int) -> Tensor:
    """Cumulative score of each finished slot on the beam (-inf elsewhere), from the score history."""
    last = scores.view(S, k, -1).gather(2, (done_len - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return last.masked_fill(done_len.eq(0), -math.inf)


def stay_step(cand, local, k, vocab, eos, pad, pruning: Pruning, step, done_len, scores, empty, ids,
              word_of=None, compiled: Optional[bool] = None) -> StayStep:
    """:func:`select_stay` and what the decoder tracks after it, as one step.

    ``scores`` is the cohort's (S * k, width) history of cumulative scores,
    from which each finished entry's score is read (``done_len`` is its
    length). A sentence ends when no live hypothesis is left on its beam, or
    at once for an empty source. ``compiled``: as :func:`fairseq_step`.
    """
    if compiled is None:
        compiled = beam_step.select_available(cand)
    S = cand.size(0)
    if compiled:
        (parent, token, score, live, done, fresh, no_live, new_done_len, finished_now, summary, flat_parent,
         extended) = beam_step.stay_select(cand, local, word_of, vocab, k, eos, pad, step, done_len, scores,
                                           empty, ids, pruning)
        sel = Step(parent=parent, token=token, score=score, live=live, done=done, fresh=fresh, finished=no_live)
        return StayStep(sel, new_done_len, finished_now, summary, flat_parent, extended)

    sel = select_stay(cand, local, done_scores(done_len, scores, S, k), k, vocab, eos, pad, pruning, word_of)
    new_done_len = torch.where(
        sel.fresh, torch.full_like(sel.parent, step + 1), done_len.gather(1, sel.parent)
    ).masked_fill(~sel.done, 0)
    finished_now = sel.finished | empty
    live_left = (sel.live & ~finished_now.unsqueeze(1)).sum().view(1)
    summary = torch.cat([finished_now.long() + empty.long() * 2, ids.long(), live_left])
    flat_parent = (sel.parent + torch.arange(S, device=cand.device).unsqueeze(1) * k).view(-1)
    return StayStep(sel, new_done_len, finished_now, summary, flat_parent, (sel.live | sel.fresh).view(-1))
