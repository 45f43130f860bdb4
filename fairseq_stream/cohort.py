"""A cohort: sentences whose target prefixes have the same length, decoded together.

``--generator batch`` decodes one cohort per fairseq batch from start to end.
The streaming scheduler keeps several (sentences admitted at different times
have different lengths), splits one to respect a step capacity or to admit
part of an encoded batch, and joins two once their lengths meet.

Layout (as in :mod:`fairseq_stream.decoder`): slot ``j`` of sentence ``s`` is
row ``s * k + j`` of ``tokens``/``scores``; ``run_rows`` are the slots
the decoder runs next step, in the order of the runner's rows in ``state``.

Sentences at different lengths in one cohort (:meth:`Cohort.merge`, for
runners whose states join across lengths): ``step`` is then a clock, the
column every sentence writes next, and sentence ``s``'s prefix begins at
column ``start[s]`` (its own step is ``step - start[s]``; the columns before
it hold padding and zero scores). Whatever is compared with the step is kept
in the same clock: ``max_lens`` is shifted by ``start`` and ``done_len``
holds columns. So the search step reads and writes one column for all
sentences, as it does for a cohort at one length, and a pool whose every
call runs every sentence (top-up, FIFO without a capacity) makes one search
update per call instead of one per group of sentences admitted together.
"""

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
from torch import Tensor



def _shift_columns(t: Tensor, shift: int, value) -> Tensor:
    """``t`` with its columns moved ``shift`` to the right (``value`` comes in) or left (columns drop)."""
    if shift > 0:
        return torch.cat([t.new_full((t.size(0), shift), value), t], dim=1)
    return t[:, -shift:] if shift < 0 else t


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
    # (S,) the column where each sentence's prefix begins (see the module docstring), and the same on
    # the host; None: 0 for every sentence (one length)
    start: Optional[Tensor] = None
    start_host: Optional[List[int]] = None
    # ids on the host: as handed to open_cohort on the host, kept through splits, joins and departures; None:
    # handed on the device, read once by a late reader (late_reads.py) where one needs them
    ids_host: Optional[List[int]] = None

    @property
    def size(self) -> int:
        return self.ids.numel()

    @property
    def rows(self) -> int:
        """Decoder rows the next step would run."""
        return self.run_rows.numel()

    @property
    def mixed(self) -> bool:
        """Whether its sentences' prefixes differ in length (:meth:`merge`)."""
        return self.start is not None

    @property
    def longest(self) -> int:
        """The longest prefix's own step (``step`` for a cohort at one length)."""
        return self.step - min(self.start_host) if self.mixed and self.start_host else self.step

    def shifted(self, shift: int) -> "Cohort":
        """The same cohort with its columns moved ``shift`` to the right (left if negative), in place.

        Columns only move: nothing written is dropped (a left shift must not
        pass any sentence's start).
        """
        if shift == 0:
            return self
        start = self.start if self.mixed else torch.zeros_like(self.ids)
        start_host = self.start_host if self.mixed else [0] * self.size
        if shift < 0 and start_host and min(start_host) + shift < 0:
            raise ValueError("internal: shifting a cohort past a sentence's start")
        self.tokens = _shift_columns(self.tokens, shift, self.pad)
        self.scores = _shift_columns(self.scores, shift, 0.0)
        self.max_lens = self.max_lens + shift
        self.done_len = torch.where(self.done_len.gt(0), self.done_len + shift, self.done_len)
        self.step += shift
        self.start, self.start_host = start + shift, [s + shift for s in start_host]
        return self

    def select(self, runner, keep: Tensor, keep_host: List[int]) -> "Cohort":
        """A new cohort with the sentences at positions ``keep`` (sorted), state included; ``keep_host``: the
        same positions on the host (nothing is read back)."""
        k = self.k
        slots = (keep.unsqueeze(1) * k + torch.arange(k, device=keep.device)).view(-1)
        if self.run_rows.numel() == self.size * k:
            # Every slot runs: the run rows are the slots in order (rows_to_run, concat), so the kept slots are
            # the runner rows to take, with no data-dependent count to read.
            runner_rows, run_rows = slots, torch.arange(slots.numel(), device=keep.device)
        else:
            slot_pos = torch.full((self.size * k,), -1, dtype=torch.long, device=keep.device)
            slot_pos[slots] = torch.arange(slots.numel(), device=keep.device)
            run_kept = slot_pos[self.run_rows].ge(0)
            runner_rows = run_kept.nonzero().flatten()
            run_rows = slot_pos[self.run_rows[run_kept]]
        state = runner.take(self.state, runner_rows)
        ids = self.ids[keep]
        ids_host = [self.ids_host[i] for i in keep_host] if self.ids_host is not None else None
        start = start_host = None
        if self.mixed:
            start = self.start[keep]
            start_host = [self.start_host[i] for i in keep_host]
        return Cohort(
            k=k, pad=self.pad, step=self.step, ids=ids,
            tokens=self.tokens[slots], scores=self.scores[slots],
            live=self.live[keep], done_len=self.done_len[keep], max_lens=self.max_lens[keep],
            empty=self.empty[keep], best_finished=self.best_finished[keep],
            run_rows=run_rows,
            state=state,
            finalized=self._finalized_of(ids, ids_host),
            admitted=self.admitted, start=start, start_host=start_host, ids_host=ids_host,
        )

    def _finalized_of(self, ids: Tensor, ids_host: Optional[List[int]]) -> Dict[int, List[dict]]:
        """The finalized hypotheses (fairseq's rule) of the sentences ``ids`` (read only where some are held and
        their ids are not on the host)."""
        if not self.finalized:
            return {}
        return {i: self.finalized[i] for i in (ids_host if ids_host is not None else ids.tolist())
                if i in self.finalized}

    @staticmethod
    def merge(runner, cohorts: List["Cohort"]) -> "Cohort":
        """Join cohorts at any steps into one whose sentences keep their own lengths (in place).

        Each cohort's columns move so that all write the same column next:
        the longest prefix's length, so that columns no sentence uses any
        more (those of sentences that ended) are dropped. ``runner`` must
        join states of different lengths (``runner.joins_lengths``).
        """
        if len(cohorts) == 1:
            return cohorts[0]
        clock = max(c.longest for c in cohorts)
        return Cohort.concat(runner, [c.shifted(clock - c.step) for c in cohorts], any_length=True)

    @staticmethod
    def concat(runner, cohorts: List["Cohort"], any_length: bool = False) -> "Cohort":
        """Join cohorts at the same step into one (sentences in the given order).

        ``any_length``: the states may be at different lengths (:meth:`merge`).
        """
        if len(cohorts) == 1:
            return cohorts[0]
        assert len({c.step for c in cohorts}) == 1, "only cohorts at the same step join"
        state = runner.concat([c.state for c in cohorts], any_length=any_length)
        width = max(c.tokens.size(1) for c in cohorts)
        run_rows, total = [], 0
        for c in cohorts:
            run_rows.append(c.run_rows + total)
            total += c.size * c.k
        finalized = {}
        for c in cohorts:
            finalized.update(c.finalized)
        start = start_host = None
        if any(c.mixed for c in cohorts):
            start = torch.cat([c.start if c.mixed else torch.zeros_like(c.ids) for c in cohorts])
            start_host = [s for c in cohorts for s in (c.start_host if c.mixed else [0] * c.size)]
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
            start=start, start_host=start_host,
            ids_host=[i for c in cohorts for i in c.ids_host] if all(c.ids_host is not None for c in cohorts)
            else None,
        )
