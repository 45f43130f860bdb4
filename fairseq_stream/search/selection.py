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


def select_fairseq(cand, local, k, vocab, eos, pruning: Pruning, best_finished=None, word_of=None):
    """fairseq's rule; ``finished`` only reports sentences whose beam emptied by pruning.

    The caller counts finalized hypotheses (a sentence with ``k`` of them, or
    at its maximum length, also ends).
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
