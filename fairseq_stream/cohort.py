"""A cohort: sentences whose target prefixes have the same length, decoded together.

``--generator batch`` decodes one cohort per fairseq batch from start to end.
The streaming scheduler keeps several (sentences admitted at different times
have different lengths), splits one to respect a step capacity or to admit
part of an encoded batch, and joins two once their lengths meet.

Layout (as in :mod:`fairseq_stream.decoder`): slot ``j`` of sentence ``s`` is
row ``s * k + j`` of ``tokens``/``scores``; ``run_rows`` are the slots
the decoder runs next step, in the order of the runner's rows in ``state``.
"""

from dataclasses import dataclass, field
from typing import Dict, List

import torch
from torch import Tensor



def _pad_to(t: Tensor, sizes: Dict[int, int], value) -> Tensor:
    """Right-pad ``t`` along the given dims to the given sizes."""
    for dim, size in sizes.items():
        extra = size - t.size(dim)
        if extra > 0:
            shape = list(t.shape)
            shape[dim] = extra
            t = torch.cat([t, t.new_full(shape, value)], dim=dim)
    return t


@dataclass
class Cohort:
    """The search state of ``S`` sentences at the same ``step``."""

    k: int
    pad: int
    step: int
    ids: Tensor  # (S,) caller's sentence ids
    tokens: Tensor  # (S*k, width + 2)
    scores: Tensor  # (S*k, width + 1)
    live: Tensor  # (S, k) unfinished hypotheses to extend
    # (S, k) stay: length of the finished hypotheses on the beam; fairseq: the
    # lengths of the sentence's finalized hypotheses, in order (0: none yet)
    done_len: Tensor
    max_lens: Tensor  # (S,)
    empty: Tensor  # (S,) empty source
    best_finished: Tensor  # (S,)
    run_rows: Tensor  # slots the decoder runs next, in the runner's row order
    state: object  # the runner's state of the run rows
    finalized: Dict[int, List[dict]] = field(default_factory=dict)  # fairseq finalization
    admitted: int = 0  # the pool's decoder-call count when its earliest sentence was admitted

    @property
    def size(self) -> int:
        return self.ids.numel()

    @property
    def rows(self) -> int:
        """Decoder rows the next step would run."""
        return self.run_rows.numel()

    def select(self, runner, keep: Tensor) -> "Cohort":
        """A new cohort with the sentences at positions ``keep`` (sorted), state included."""
        k = self.k
        slots = (keep.unsqueeze(1) * k + torch.arange(k, device=keep.device)).view(-1)
        slot_pos = torch.full((self.size * k,), -1, dtype=torch.long, device=keep.device)
        slot_pos[slots] = torch.arange(slots.numel(), device=keep.device)
        run_kept = slot_pos[self.run_rows].ge(0)
        runner_rows = run_kept.nonzero().flatten()
        state = runner.take(self.state, runner_rows)
        ids = self.ids[keep]
        return Cohort(
            k=k, pad=self.pad, step=self.step, ids=ids,
            tokens=self.tokens[slots], scores=self.scores[slots],
            live=self.live[keep], done_len=self.done_len[keep], max_lens=self.max_lens[keep],
            empty=self.empty[keep], best_finished=self.best_finished[keep],
            run_rows=slot_pos[self.run_rows[run_kept]],
            state=state,
            finalized={i: self.finalized[i] for i in ids.tolist() if i in self.finalized},
            admitted=self.admitted,
        )

    @staticmethod
    def concat(runner, cohorts: List["Cohort"]) -> "Cohort":
        """Join cohorts at the same step into one (sentences in the given order)."""
        if len(cohorts) == 1:
            return cohorts[0]
        assert len({c.step for c in cohorts}) == 1, "only cohorts at the same step join"
        state = runner.concat([c.state for c in cohorts])
        width = max(c.tokens.size(1) for c in cohorts)
        run_rows, total = [], 0
        for c in cohorts:
            run_rows.append(c.run_rows + total)
            total += c.size * c.k
        finalized = {}
        for c in cohorts:
            finalized.update(c.finalized)
        first = cohorts[0]
        return Cohort(
            k=first.k, pad=first.pad, step=first.step,
            ids=torch.cat([c.ids for c in cohorts]),
            tokens=torch.cat([_pad_to(c.tokens, {1: width}, c.pad) for c in cohorts]),
            scores=torch.cat([_pad_to(c.scores, {1: width - 1}, 0.0) for c in cohorts]),
            live=torch.cat([c.live for c in cohorts]),
            done_len=torch.cat([c.done_len for c in cohorts]),
            max_lens=torch.cat([c.max_lens for c in cohorts]),
            empty=torch.cat([c.empty for c in cohorts]),
            best_finished=torch.cat([c.best_finished for c in cohorts]),
            run_rows=torch.cat(run_rows),
            state=state,
            finalized=finalized,
            admitted=min(c.admitted for c in cohorts),
        )
