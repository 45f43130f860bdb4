"""The streaming pool (Yang et al. 2020, Algorithm 1): refill at ε, expand the shortest.

Input arrives as encoded batches (each a :class:`~fairseq_stream.cohort.Cohort`
at step 0, kept whole so that the encoder sees exactly fairseq's batches).
The pool holds at most ``pool_size`` sentences. When the active sentences (or
live rows, see ``refill_unit``) fall to ``ε`` times the pool's capacity or
below, it admits new sentences until the pool is full again, taking part of an
encoded batch if need be. Each step expands one cohort: the one whose prefixes
are shortest, so a decoder call never mixes lengths and long prefixes wait
while new sentences catch up (their self-attention steps are the expensive
ones). Cohorts whose lengths meet are joined into one decoder call.

``order="fifo"`` is the paper's VAR-STR-FIFO (App. A.2): each decoder call
takes cohorts from the longest prefix down, up to the capacity (all of them
without one), padding every row to the longest prefix in the call; a cohort
runs its first step on its own (it has no decoder state to pad yet).

Options beyond the paper:

* ``capacity``: at most this many decoder rows (or rows x prefix length,
  ``capacity_unit="tokens"``) per decoder call; a cohort above it is split and
  the parts are decoded in turn (end of the paper's §3);
* ``max_wait``: cohorts that have not been expanded for this many decoder
  calls are expanded next, together in one padded call as FIFO does, whatever
  their length (the paper's footnote 3): no translation is held back longer
  by refills (that call may exceed the capacity).

None of this changes what is decoded, only when: every sentence goes through
the same search steps as with ``--generator batch``.
"""

from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from fairseq_stream.cohort import Cohort
from fairseq_stream.errors import FairseqStreamError

ORDERS = ("shortest", "fifo")
REFILL_UNITS = ("sentences", "rows")
CAPACITY_UNITS = ("rows", "tokens")


class StreamPool:
    """Decode a stream of encoded batches through a bounded pool.

    Args:
        decoder: a :class:`~fairseq_stream.decoder.BeamDecoder` (its search,
            runner and statistics are used as they are).
        pool_size: n, the most sentences held (encoded and decoding) at once,
            besides the one encoded batch being admitted.
        eps: refill threshold ε in (0, 1].
        refill_unit: ``sentences`` (the paper: refill when at most ε·n
            sentences are active, up to n sentences) or ``rows`` (the pool
            holds n·k live hypotheses, what a fixed-width batch of n would
            run: refill when at most ε·n·k are live, admitting sentences
            until n·k are live; variable-width beams then fill each step).
        capacity: most rows (or tokens) per decoder call; None for no limit.
        capacity_unit: ``rows`` or ``tokens`` (rows x prefix length).
        max_wait: expand a cohort that waited this many steps (0: never force).
        order: ``shortest`` (VAR-STREAM) or ``fifo`` (VAR-STR-FIFO).
    """

    def __init__(self, decoder, pool_size: int, eps: float = 1 / 6, refill_unit: str = "sentences",
                 capacity: Optional[int] = None, capacity_unit: str = "rows", max_wait: int = 0,
                 order: str = "shortest"):
        if pool_size < 1:
            raise FairseqStreamError("--stream-pool must be at least 1, got {}".format(pool_size))
        if not (0.0 < eps <= 1.0):
            raise FairseqStreamError("--stream-eps must be in (0, 1], got {}".format(eps))
        if refill_unit not in REFILL_UNITS:
            raise FairseqStreamError("--stream-refill-unit must be one of {}".format(", ".join(REFILL_UNITS)))
        if capacity_unit not in CAPACITY_UNITS:
            raise FairseqStreamError("--stream-capacity-unit must be one of {}".format(", ".join(CAPACITY_UNITS)))
        if capacity is not None and capacity < 1:
            raise FairseqStreamError("--stream-capacity must be at least 1, got {}".format(capacity))
        if order not in ORDERS:
            raise FairseqStreamError("order must be one of {}".format(", ".join(ORDERS)))
        if max_wait < 0:
            raise FairseqStreamError("--stream-max-wait must be >= 0, got {}".format(max_wait))
        self.decoder = decoder
        self.runner = decoder.runner
        self.pool_size = pool_size
        self.eps = eps
        self.refill_unit = refill_unit
        self.capacity = capacity
        self.capacity_unit = capacity_unit
        self.max_wait = max_wait
        self.order = order
        self.peak_sentences = 0  # most sentences held at once, encoded ones waiting included
        self.peak_wait = 0  # longest any cohort went without being expanded, in decoder calls

    # -- public --------------------------------------------------------------

    def run(self, batches: Iterable[Cohort]) -> Iterator[Tuple[int, List[dict]]]:
        """Yield ``(sentence id, hypotheses)`` as sentences finish; each id exactly once.

        Args:
            batches: encoded batches, each a cohort at step 0 (see
                :meth:`BeamDecoder.open`), pulled only when the pool refills.
        """
        source = iter(batches)
        staging: List[Cohort] = []
        cohorts: List[Cohort] = []
        exhausted = False
        stats = self.decoder.stats
        while True:
            if not exhausted and self._should_refill(cohorts):
                exhausted = self._refill(source, staging, cohorts)
                stats.refills += 1
                held = sum(c.size for c in cohorts) + sum(c.size for c in staging)
                self.peak_sentences = max(self.peak_sentences, held)
            if not cohorts:
                if exhausted and not staging:
                    return
                continue
            chosen = self._choose_fifo(cohorts) if self.order == "fifo" else self._choose(cohorts)
            for c in cohorts:
                c.waited += 1
            for c in chosen:
                self.peak_wait = max(self.peak_wait, c.waited - 1)
                c.waited = 0
            for sid, hyps in self.decoder.advance_together(chosen).items():
                yield sid, hyps
            cohorts = [c for c in cohorts if c.size]
            cohorts = self._join_equal_lengths(cohorts)

    # -- policy ----------------------------------------------------------------

    def _active(self, cohorts) -> int:
        if self.refill_unit == "rows":
            return sum(c.rows for c in cohorts)
        return sum(c.size for c in cohorts)

    def _limit(self) -> int:
        """The pool's capacity in the refill unit."""
        if self.refill_unit == "rows":
            return self.pool_size * self.decoder.beam_size
        return self.pool_size

    def _should_refill(self, cohorts) -> bool:
        return self._active(cohorts) <= self.eps * self._limit()

    def _refill(self, source, staging: List[Cohort], cohorts: List[Cohort]) -> bool:
        """Admit sentences until the pool is full; True once the source is exhausted."""
        need = self._limit() - self._active(cohorts)
        # A new sentence runs one row (k when the search keeps every slot).
        per_sentence = self.decoder.beam_size if self.decoder.dense and self.refill_unit == "rows" else 1
        need = -(-need // per_sentence)
        admitted: List[Cohort] = []
        exhausted = False
        while need > 0:
            if not staging:
                batch = next(source, None)
                if batch is None:
                    exhausted = True
                    break
                if batch.size == 0:
                    continue
                staging.append(batch)
            head = staging[0]
            if head.size <= need:
                admitted.append(staging.pop(0))
                need -= head.size
            else:
                # Keep the batch encoded as a whole (the encoder sees fairseq's
                # batch) and admit its first sentences.
                idx = torch.arange(head.size, device=head.ids.device)
                admitted.append(head.select(self.runner, idx[:need]))
                staging[0] = head.select(self.runner, idx[need:])
                need = 0
        if admitted:
            cohorts.extend(admitted)
            cohorts[:] = self._join_equal_lengths(cohorts)
        return exhausted and not staging

    def _choose(self, cohorts: List[Cohort]) -> List[Cohort]:
        """The cohorts for the next call: the shortest (split to capacity), or all overdue ones."""
        overdue = [c for c in cohorts if self.max_wait and c.waited >= self.max_wait and c.step > 0]
        if overdue:
            # One padded call over every overdue cohort (as FIFO does), so no
            # cohort waits longer than --stream-max-wait.
            return overdue
        return [self._choose_among(cohorts, min(cohorts, key=lambda c: c.step))]

    def _choose_among(self, cohorts: List[Cohort], chosen: Cohort) -> Cohort:
        """``chosen``, or its first sentences up to the capacity (the rest stay in ``cohorts``)."""
        if self.capacity is None or self._cost(chosen.rows, chosen.step) <= self.capacity:
            return chosen
        # Split the chosen cohort: its first sentences up to the capacity run
        # now, the rest wait (they are the shortest, so they run next).
        rows_per_sentence = torch.bincount(chosen.run_rows // chosen.k, minlength=chosen.size)
        cost = torch.cumsum(rows_per_sentence, 0)
        fits = int((self._cost(cost, chosen.step) <= self.capacity).sum())
        fits = max(fits, 1)
        idx = torch.arange(chosen.size, device=chosen.ids.device)
        first, rest = chosen.select(self.runner, idx[:fits]), chosen.select(self.runner, idx[fits:])
        position = next(i for i, c in enumerate(cohorts) if c is chosen)
        cohorts[position:position + 1] = [first, rest]
        return first

    def _choose_fifo(self, cohorts: List[Cohort]) -> List[Cohort]:
        """Cohorts for one padded call: longest prefixes first, up to the capacity."""
        starting = [c for c in cohorts if c.step == 0]
        if starting:
            return [self._choose_among(cohorts, starting[0])]
        overdue = self.max_wait and max(c.waited for c in cohorts) >= self.max_wait
        ordered = sorted(cohorts, key=lambda c: (-(c.waited >= self.max_wait) if overdue else 0, -c.step))
        if self.capacity is None:
            return ordered
        chosen, rows = [], 0
        longest = max(c.step for c in ordered[:1])
        for c in ordered:
            longest = max(longest, c.step)
            if chosen and self._cost(rows + c.rows, longest) > self.capacity:
                break
            chosen.append(c)
            rows += c.rows
        if len(chosen) == 1:
            # One cohort above the capacity is split as in the shortest-first order.
            first = self._choose_among(cohorts, chosen[0])
            return [first]
        return chosen

    def _cost(self, rows, step):
        if self.capacity_unit == "tokens":
            return rows * (step + 1)
        return rows

    def _join_equal_lengths(self, cohorts: List[Cohort]) -> List[Cohort]:
        """Join cohorts at the same step into one decoder call (within the capacity)."""
        by_step: Dict[int, List[Cohort]] = {}
        for c in cohorts:
            by_step.setdefault(c.step, []).append(c)
        joined = []
        for step, group in by_step.items():
            current = [group[0]]
            for c in group[1:]:
                rows = sum(x.rows for x in current) + c.rows
                if self.capacity is not None and self._cost(rows, step) > self.capacity:
                    joined.append(Cohort.concat(self.runner, current))
                    current = [c]
                else:
                    current.append(c)
            joined.append(Cohort.concat(self.runner, current))
        return joined
