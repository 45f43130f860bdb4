"""The search policies: a cohort's step from its candidates to the survivors and the finished, as objects.

fairseq keeps each search behind ``Search.step`` (``fairseq/search.py``),
CTranslate2 behind ``SearchStrategy::search``
(``include/ctranslate2/decoding.h``); here a policy is what the engine
(:class:`~fairseq_stream.engine.Engine`) calls as its
:class:`~fairseq_stream.engine.SearchPolicy`: ``select(cohort,
candidates)``, the candidates being the model call's ``(cand, local,
word_of, per_slot)`` (:func:`fairseq_stream.candidates.candidates`). Two
rules, each holding only what it reads (the beam width, the special
symbols, the pruning):

* :class:`FairseqPolicy`: fairseq's finalization
  (:func:`~fairseq_stream.search.selection.fairseq_step`);
* :class:`StayPolicy`: finished hypotheses stay on the beam
  (:func:`~fairseq_stream.search.selection.stay_step`).

Fixed width, variable width (a :class:`~fairseq_stream.search.pruning.Pruning`)
and greedy (k = 1) are these two at their parameters: :func:`search_policy`
makes the one of a decoder's settings. What follows the step (the
finalized hypotheses stored, the next beam) is the bookkeeping's
(:class:`~fairseq_stream.cohort_steps.BeamBookkeeping`).
"""

from typing import Optional

from torch import Tensor

from fairseq_stream.cohort import Cohort
from fairseq_stream.search.pruning import Pruning
from fairseq_stream.search.selection import FairseqStep, StayStep, fairseq_step, forced_eos_ranks, stay_step


class FairseqPolicy:
    """fairseq's rule over a beam of ``k`` slots: EOS among the best k of 2k is finalized at once, the next beam
    is the best k others.

    ``forced_eos``: whether a beam can be forced to take an EOS (a dense
    beam of V - 1 slots, where fairseq ignores those ranks at the next step:
    :meth:`ignore_ranks`).
    """

    def __init__(self, k: int, eos: int, pruning: Pruning, forced_eos: bool = False):
        self.k, self.eos, self.pruning, self.forced_eos = k, eos, pruning, forced_eos

    def select(self, c: Cohort, found: tuple) -> FairseqStep:
        """``c``'s step over its candidates ``found``; the best finalized score so far stays on ``c``."""
        cand, local, word_of, per_slot = found
        # No finished hypothesis stays on the beam here, so done_len counts
        # the finalized ones instead (see fairseq_step): the count travels
        # with the sentence when cohorts split or join.
        step_out = fairseq_step(cand, local, self.k, per_slot, self.eos, self.pruning, c.step, c.done_len,
                                c.best_finished, c.max_lens, c.empty, c.ids, word_of, ignore=self.ignore_ranks(c))
        c.best_finished = step_out.best_finished
        return step_out

    def ignore_ranks(self, c: Cohort) -> Optional[Tensor]:
        """fairseq's ranks to ignore at ``c``'s step (:func:`~fairseq_stream.search.selection.forced_eos_ranks`),
        or None: only a beam that can be forced to take an EOS has any, after its first step."""
        if not (self.forced_eos and c.step > 0):
            return None
        S, k = c.size, self.k
        return forced_eos_ranks(c.tokens[:, c.step].view(S, k), c.scores[:, c.step - 1].view(S, k), self.eos)


class StayPolicy:
    """The streaming paper's rule over a beam of ``k`` slots (Yang et al. 2020, App. A.1): finished candidates
    stay on the beam and compete with new expansions; a sentence ends when no live one is left."""

    def __init__(self, k: int, eos: int, pad: int, pruning: Pruning):
        self.k, self.eos, self.pad, self.pruning = k, eos, pad, pruning

    def select(self, c: Cohort, found: tuple) -> StayStep:
        """``c``'s step over its candidates ``found``."""
        cand, local, word_of, per_slot = found
        return stay_step(cand, local, self.k, per_slot, self.eos, self.pad, self.pruning, c.step, c.done_len,
                         c.scores, c.empty, c.ids, word_of)


def search_policy(finalize: str, k: int, vocab_size: int, eos: int, pad: int, pruning: Pruning, dense: bool):
    """The policy of a decoder's settings: rule ``finalize`` (``fairseq`` or ``stay``), beam ``k`` over
    ``vocab_size`` words, ``pruning``; ``dense``: every slot is a row (fairseq's exact arithmetic)."""
    if finalize == "stay":
        return StayPolicy(k, eos, pad, pruning)
    return FairseqPolicy(k, eos, pruning, forced_eos=dense and k >= vocab_size - 1)
