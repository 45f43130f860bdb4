"""The engine's planners: which cohorts refill, join, split and step, as plans.

Split vLLM's way (``vllm/v1/core/sched/interface.py``: ``schedule()`` returns
a ``SchedulerOutput``, ``update_from_output`` takes the results back): a
planner reads cohorts (their sizes, steps, rows and admission clocks) and
returns what to do; it holds no decoder and never calls a model. The engine's
loop (:class:`~fairseq_stream.engine.Engine`) executes each plan through the
decoder's stepping interface (:class:`~fairseq_stream.engine.CohortDecoder`:
``split``, ``join``, then the step's model call, search policy and
bookkeeping) and feeds the results back.

:class:`BatchPlanner` is ``--generator batch``'s: its batch admitted whole,
stepped until every sentence finished. :class:`PoolPlanner` is the streaming
pool's (:class:`~fairseq_stream.schedule.pool.StreamPool`):

* :meth:`PoolPlanner.should_refill` / :meth:`PoolPlanner.refill_need`: when
  to admit sentences, and how many (the loop pulls and splits batches);
* :meth:`PoolPlanner.joins`: which cohorts become one (a list of
  :class:`Join` and cohorts kept as they are); :meth:`PoolPlanner.joined`
  takes each joined cohort back;
* :meth:`PoolPlanner.schedule`: the next decoder call (a :class:`StepPlan`:
  the cohorts it runs, and the split that comes first where one is above the
  capacity); :meth:`PoolPlanner.update_from_output` advances the clock that
  the latency guard counts in.

The policies (shortest first, FIFO, the capacity, the latency guard) are the
module docstring's of :mod:`fairseq_stream.schedule.pool`.
"""

import sys
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch

from fairseq_stream.cohort import Cohort


@dataclass
class StepPlan:
    """One decoder call: the cohorts it runs, in order.

    ``split``: where set, ``run`` is one cohort above the capacity; its first
    ``split`` sentences run, the rest take its place after them and wait.
    """

    run: List[Cohort]
    split: Optional[int] = None
    # Whether the call runs new sentences' first step (the latency guard's clock does not count it); read
    # when planned: the call moves its cohorts on in place.
    lone_first_step: bool = field(init=False)

    def __post_init__(self):
        self.lone_first_step = self.run[0].step == 0


@dataclass
class Join:
    """Cohorts to join into one: at one step, or at any step (``any_length``: the decoder's merge).

    ``lag``: the largest lag of the parts, which a merged cohort keeps
    (:meth:`PoolPlanner.joined`; None: the join's own).
    """

    cohorts: List[Cohort]
    any_length: bool = False
    lag: Optional[int] = None


class PoolPlanner:
    """The pool's policy over its cohorts (the arguments are :class:`~fairseq_stream.schedule.pool.StreamPool`'s).

    Args:
        beam_size: the decoder's k (``refill_unit="rows"`` counts n·k rows).
        first_step_rows: rows a new sentence runs at its first step.
        can_join: whether a cohort may join one at another step (the decoder's rule).
        joins_lengths: every call runs every cohort, and cohorts past their
            first step are merged into one (FIFO without a capacity, on a
            runner that holds rows of different lengths).
        stats: the run's counters (a :class:`~fairseq_stream.stats.DecodeStats`), to which the planner adds
            its refills and the peak lag, as vLLM's scheduler makes its own statistics.
    """

    def __init__(self, pool_size: int, eps: float, refill_unit: str, capacity: Optional[int], capacity_unit: str,
                 max_wait: int, order: str, beam_size: int, first_step_rows: int,
                 can_join: Callable[[Cohort], bool], joins_lengths: bool, stats):
        self.pool_size, self.eps, self.refill_unit = pool_size, eps, refill_unit
        self.capacity, self.capacity_unit = capacity, capacity_unit
        self.max_wait, self.order = max_wait, order
        self.beam_size, self.first_step_rows, self.can_join = beam_size, first_step_rows, can_join
        self.joins_lengths, self.stats = joins_lengths, stats
        self.clock = 0  # decoder calls made so far, lone first steps not counted (see max_wait)

    # -- refill ------------------------------------------------------------

    def active(self, cohorts: List[Cohort]) -> int:
        """What the refill threshold counts: sentences, or live rows."""
        if self.refill_unit == "rows":
            return sum(c.rows for c in cohorts)
        return sum(c.size for c in cohorts)

    def limit(self) -> int:
        """The pool's capacity in the refill unit."""
        if self.refill_unit == "rows":
            return self.pool_size * self.beam_size
        return self.pool_size

    def should_refill(self, cohorts: List[Cohort]) -> bool:
        """Whether the active count fell to ε times the capacity."""
        return self.active(cohorts) <= self.eps * self.limit()

    def refill_need(self, cohorts: List[Cohort]) -> int:
        """How many sentences to admit to fill the pool again."""
        need = self.limit() - self.active(cohorts)
        per_sentence = self.first_step_rows if self.refill_unit == "rows" else 1
        return -(-need // per_sentence)

    def held(self, batch: int, ahead: int) -> Tuple[int, int]:
        """The most sentences held at once: the pool's (dense searches: ``limit`` in either unit is
        ``pool_size`` sentences), an encoded batch being admitted and ``ahead`` more; and a batch copied at a
        split."""
        return self.pool_size + batch * (1 + ahead), batch

    def admit(self, cohorts: List[Cohort]):
        """Record that ``cohorts`` enter the pool now (their lag counts from here; a refill where any do)."""
        for c in cohorts:
            c.admitted = self.clock
        if cohorts:
            self.stats.refills += 1

    # -- the next call -----------------------------------------------------

    def schedule(self, cohorts: List[Cohort]) -> StepPlan:
        """The next decoder call over ``cohorts`` (shortest first or FIFO, within the capacity)."""
        self.stats.peak_lag = max([self.stats.peak_lag] + [self.lag(c) for c in cohorts])
        return self._choose_fifo(cohorts) if self.order == "fifo" else self._choose(cohorts)

    def update_from_output(self, plan: StepPlan):
        """The call of ``plan`` ran: the clock moves on (not for a lone first step)."""
        if not plan.lone_first_step:
            self.clock += 1

    def lag(self, c: Cohort) -> int:
        """Decoder calls since ``c``'s earliest sentence was admitted that did not expand it.

        Its first step ran in a lone first-step call, which the clock does not
        count; each later step ran in a counted call.
        """
        return self.clock - c.admitted - max(c.step - 1, 0)

    def _overdue(self, c: Cohort) -> bool:
        return bool(self.max_wait) and c.step > 0 and self.lag(c) >= self.max_wait

    def _choose(self, cohorts: List[Cohort]) -> StepPlan:
        """The shortest cohort (split to capacity), or the overdue ones and it."""
        shortest = min(cohorts, key=lambda c: c.step)
        overdue = self._overdue_first(cohorts) if shortest.step > 0 else []
        if not overdue:
            # (A first step has no decoder state to pad and share: it runs on its own.)
            return self._within_capacity(shortest)
        # One padded call over the overdue cohorts and the shortest (as FIFO
        # does), so an overdue cohort is passed over no more.
        if not any(c is shortest for c in overdue):
            overdue.append(shortest)
        return self._fill(overdue)

    def _within_capacity(self, chosen: Cohort) -> StepPlan:
        """``chosen``, or (split) its first sentences up to the capacity; the rest wait, the shortest, to run
        next."""
        if self.capacity is None or self._cost(chosen.rows, chosen.step) <= self.capacity:
            return StepPlan([chosen])
        rows_per_sentence = torch.bincount(chosen.run_rows // chosen.k, minlength=chosen.size)
        cost = torch.cumsum(rows_per_sentence, 0)
        fits = int((self._cost(cost, chosen.step) <= self.capacity).sum())
        return StepPlan([chosen], split=max(fits, 1))

    def _choose_fifo(self, cohorts: List[Cohort]) -> StepPlan:
        """Cohorts for one padded call: the overdue ones, then the longest prefixes, up to the capacity."""
        starting = [c for c in cohorts if c.step == 0]
        if starting:
            return self._within_capacity(starting[0])
        overdue = self._overdue_first(cohorts)
        rest = sorted((c for c in cohorts if not any(c is o for o in overdue)), key=lambda c: -c.step)
        return self._fill(overdue + rest)

    def _overdue_first(self, cohorts: List[Cohort]) -> List[Cohort]:
        """The overdue cohorts, the longest passed over first."""
        return sorted((c for c in cohorts if self._overdue(c)), key=lambda c: -self.lag(c))

    def _fill(self, ordered: List[Cohort]) -> StepPlan:
        """The first of ``ordered`` that fit in one call's capacity (a lone one above it is split)."""
        if self.capacity is None:
            return StepPlan(ordered)
        chosen, rows, longest = [], 0, 0
        for c in ordered:
            if chosen and self._cost(rows + c.rows, max(longest, c.step)) > self.capacity:
                break
            chosen.append(c)
            rows, longest = rows + c.rows, max(longest, c.step)
        if len(chosen) == 1:
            return self._within_capacity(chosen[0])
        return StepPlan(chosen)

    def _cost(self, rows, step):
        if self.capacity_unit == "tokens":
            return rows * (step + 1)
        return rows

    # -- joins -------------------------------------------------------------

    def joins(self, cohorts: List[Cohort]) -> List[Union[Cohort, Join]]:
        """The pool's cohorts after joining those at one step into one call (within the capacity), and (see
        ``joins_lengths``) those past their first step into one: each a :class:`Join` or a cohort kept."""
        planned: List[Union[Cohort, Join]] = []
        if self.joins_lengths:
            joinable = [c for c in cohorts if self.can_join(c)]
            cohorts = [c for c in cohorts if not self.can_join(c)]
            if len(joinable) > 1:
                # Keep the largest lag of the parts (the merge moves the step the lag is counted from).
                planned.append(Join(joinable, any_length=True, lag=max(self.lag(c) for c in joinable)))
            else:
                planned.extend(joinable)
        by_step: Dict[int, List[Cohort]] = {}
        for c in cohorts:
            by_step.setdefault(c.step, []).append(c)
        for step, group in by_step.items():
            current = [group[0]]
            for c in group[1:]:
                rows = sum(x.rows for x in current) + c.rows
                if self.capacity is not None and self._cost(rows, step) > self.capacity:
                    planned.append(Join(current))
                    current = [c]
                else:
                    current.append(c)
            planned.append(Join(current))
        return planned

    def joined(self, merged: Cohort, join: Join):
        """The cohort that ``join`` made: a merge keeps the largest lag of its parts (the merge moves the step
        the lag is counted from)."""
        if join.lag is not None:
            merged.admitted = self.clock - join.lag - max(merged.step - 1, 0)


class BatchPlanner:
    """``--generator batch``'s plan (:meth:`~fairseq_stream.decoder.BeamDecoder.generate`): each batch admitted
    whole once nothing decodes, and its one cohort stepped until every sentence finished; nothing joins or
    splits."""

    def active(self, cohorts: List[Cohort]) -> int:
        """The sentences decoding."""
        return sum(c.size for c in cohorts)

    def should_refill(self, cohorts: List[Cohort]) -> bool:
        """Only once the batch before is done."""
        return not cohorts

    def refill_need(self, cohorts: List[Cohort]) -> int:
        """A whole batch, whatever its size (never split)."""
        return sys.maxsize

    def held(self, batch: int, ahead: int) -> Tuple[int, int]:
        """One batch at a time, never split (nothing is encoded ahead)."""
        return batch, 0

    def admit(self, cohorts: List[Cohort]):
        """Nothing to record: no clock, no refills counted (a batch is not a refill)."""

    def joins(self, cohorts: List[Cohort]) -> List[Cohort]:
        """The cohort as it is."""
        return cohorts

    def joined(self, merged: Cohort, join: Join):
        """Never asked: :meth:`joins` plans none."""

    def schedule(self, cohorts: List[Cohort]) -> StepPlan:
        """The one cohort, whole."""
        return StepPlan(cohorts)

    def update_from_output(self, plan: StepPlan):
        """Nothing to record."""
