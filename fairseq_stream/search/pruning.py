"""Beam pruning heuristics of Freitag & Al-Onaizan (2017), on batched candidate tensors.

All heuristics see the candidates of each sentence sorted best first, after
the beam has been reduced to its width (as in the paper: "we first reduce the
candidate list to the current beam size and apply on top of this one or
several of the following pruning schemes"). Scores are log-probabilities.

* relative threshold ``rp`` in (0, 1]: drop a candidate whose probability is
  below ``rp`` times the best one's: ``score < best + log(rp)``;
* absolute threshold ``ap`` (δ) >= 0: drop ``score < best - ap``. The best
  may be an already finished candidate (Yang et al. 2020, App. A.3);
* relative local threshold ``rpl`` in (0, 1]: the same as ``rp`` on the
  last word's log-probability only, against the best last word among the
  candidates;
* max candidates per node ``mc`` (M) >= 1: keep at most M candidates that
  extend the same hypothesis, best first.

The paper prunes on ``<=``; we prune on ``<`` so that the best candidate
always survives (with ``<=`` and ``rp = 1`` the beam would empty itself).
Finished candidates that only carry over (no new word) are exempt from
``rpl`` and ``mc``, which are about the new word and its history.
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch

from fairseq_stream.errors import FairseqStreamError


@dataclass(frozen=True)
class Pruning:
    """Which heuristics are on (None = off) and their thresholds."""

    rp: Optional[float] = None
    ap: Optional[float] = None
    rpl: Optional[float] = None
    mc: Optional[int] = None

    def __post_init__(self):
        if self.rp is not None and not (0.0 < self.rp <= 1.0):
            raise FairseqStreamError("--prune-rp must be in (0, 1], got {}".format(self.rp))
        if self.rpl is not None and not (0.0 < self.rpl <= 1.0):
            raise FairseqStreamError("--prune-rpl must be in (0, 1], got {}".format(self.rpl))
        if self.ap is not None and (self.ap < 0 or math.isnan(self.ap)):
            raise FairseqStreamError("--prune-ap (delta) must be >= 0, got {}".format(self.ap))
        if self.mc is not None and self.mc < 1:
            raise FairseqStreamError("--prune-mc (M) must be >= 1, got {}".format(self.mc))

    @property
    def active(self):
        """True when any heuristic is on."""
        return any(v is not None for v in (self.rp, self.ap, self.rpl, self.mc))

    def keep(self, scores, local, parents, carried, best_finished=None):
        """Which candidates survive.

        Args:
            scores: (S, C) cumulative log-probabilities, each row sorted best
                first; -inf marks an empty candidate.
            local: (S, C) log-probability of each candidate's last word.
            parents: (S, C) the beam slot each candidate extends.
            carried: (S, C) bool, a finished candidate carried over unchanged.
            best_finished: (S,) best score among finished hypotheses that are
                no longer candidates (fairseq finalization), or None.

        Returns:
            (S, C) bool mask of the candidates to keep.
        """
        keep = torch.isfinite(scores)
        if not self.active:
            return keep
        best = scores[:, :1]
        if best_finished is not None:
            best = torch.maximum(best, best_finished.unsqueeze(1))
        if self.rp is not None:
            keep &= scores >= best + math.log(self.rp)
        if self.ap is not None:
            keep &= scores >= best - self.ap
        if self.rpl is not None:
            fresh_local = local.masked_fill(carried | ~torch.isfinite(scores), -math.inf)
            best_local = fresh_local.max(dim=1, keepdim=True).values
            keep &= carried | (local >= best_local + math.log(self.rpl))
        if self.mc is not None:
            # Rank of each candidate among the earlier ones extending the same
            # slot (0 = best), by pairwise comparison: C is at most 2k, and
            # unlike one-hot over the slots it needs no slot count read back
            # from the device.
            parents = parents.clamp(min=0)
            eligible = ~carried & torch.isfinite(scores)
            C = parents.size(1)
            earlier = torch.ones(C, C, dtype=torch.bool, device=parents.device).tril(-1)
            same = parents.unsqueeze(2).eq(parents.unsqueeze(1)) & earlier & eligible.unsqueeze(1)
            rank = same.sum(dim=-1)
            keep &= carried | ~eligible | (rank < self.mc)
        return keep
