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
runs its first step on its own (it has no decoder state to pad yet). Without
a capacity (top-up batching) every call runs every cohort, so where the
runner holds rows of different lengths in one state (lean, rnn) the cohorts
past their first step are joined into one
(:meth:`~fairseq_stream.cohort.Cohort.merge`): a call then makes one search
update instead of one per refill still decoding, and no row is padded.

Options beyond the paper:

* ``capacity``: at most this many decoder rows (or rows x prefix length,
  ``capacity_unit="tokens"``) per decoder call; a cohort above it is split and
  the parts are decoded in turn (end of the paper's §3);
* ``max_wait`` (the latency guard, after the paper's footnote 3): shortest
  first lets fresh short sentences go ahead of a long one at every refill,
  so without a guard a long translation can wait until the input runs out.
  A sentence's *lag* is the number of decoder calls since it was admitted
  that did not expand it, not counting the calls that run newly admitted
  sentences' first step (that step has no decoder state to pad and share a
  call with; there is one such call per refill, or per part when the
  capacity splits it). Once a cohort's lag reaches ``max_wait`` it is
  expanded in each following call, in one padded call with the shortest cohort
  (as FIFO pads), so no sentence's lag exceeds ``max_wait``. With a
  capacity, that call holds the most overdue cohorts that fit; only when the
  overdue sentences alone exceed the capacity can a lag pass ``max_wait``.
* ``may_read``: a callable asked before an encoded batch is pulled from the
  input; while it says no and sentences are still decoding, the pool decodes
  what it has instead of reading ahead (fairseq-generate bounds its cache of
  finished translations with it).

None of this changes what is decoded, only when: every sentence goes through
the same search steps as with ``--generator batch``.

The decisions are a planner's (:class:`~fairseq_stream.schedule.plan.PoolPlanner`:
which cohorts refill, join, split and step), which holds no decoder and
returns plans, as vLLM's scheduler returns a ``SchedulerOutput``.
:class:`StreamPool` is the engine (:class:`~fairseq_stream.engine.Engine`,
the one decoding loop, which ``--generator batch`` runs too) with that
planner: it executes each plan through the decoder's stepping interface
(:class:`~fairseq_stream.engine.CohortDecoder`) and feeds the results back.
"""

from typing import Optional

from fairseq_stream.engine import CohortDecoder, Engine
from fairseq_stream.errors import FairseqStreamError
from fairseq_stream.schedule.plan import PoolPlanner

ORDERS = ("shortest", "fifo")
REFILL_UNITS = ("sentences", "rows")
CAPACITY_UNITS = ("rows", "tokens")
# The latency guard's default, in decoder calls; its cost is measured by the
# streaming benchmark (docs/BENCHMARKS.md, "The latency guard").
DEFAULT_MAX_WAIT = 64


def check_pool_options(pool_size: int, eps: float, refill_unit: str = "sentences",
                       capacity: Optional[int] = None, capacity_unit: str = "rows",
                       max_wait: int = DEFAULT_MAX_WAIT, order: str = "shortest"):
    """Raise a one-line :class:`FairseqStreamError` for an invalid pool setting."""
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


class StreamPool(Engine):
    """Decode a stream of encoded batches through a bounded pool: :meth:`run` yields ``(sentence id,
    hypotheses)`` as sentences finish.

    The engine's loop (:class:`~fairseq_stream.engine.Engine`) with a
    :class:`~fairseq_stream.schedule.plan.PoolPlanner`, which decides
    (refill, join, split, step) and never calls a model; the engine executes
    each plan through the decoder's stepping interface and feeds the results
    back.

    Args:
        decoder: a :class:`CohortDecoder` (a
            :class:`~fairseq_stream.decoder.BeamDecoder`: its search, runner
            and statistics are used as they are).
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
        max_wait: expand a cohort in every call once its lag reaches this many
            decoder calls (0: no guard).
        order: ``shortest`` (VAR-STREAM) or ``fifo`` (VAR-STR-FIFO).
        join_lengths: where every call runs every cohort (FIFO, no capacity),
            join cohorts at different steps into one where the decoder can
            (see the module docstring); False keeps them apart (benchmarks
            compare the two).
    """

    def __init__(self, decoder: CohortDecoder, pool_size: int, eps: float = 1 / 6, refill_unit: str = "sentences",
                 capacity: Optional[int] = None, capacity_unit: str = "rows",
                 max_wait: int = DEFAULT_MAX_WAIT, order: str = "shortest", join_lengths: bool = True):
        check_pool_options(pool_size, eps, refill_unit, capacity, capacity_unit, max_wait, order)
        self.pool_size = pool_size
        # Every call runs every cohort (FIFO without a capacity, as top-up does): where the runner holds rows
        # of different lengths in one state, the cohorts past their first step become one (Cohort.merge),
        # so that a call makes one search update, not one per refill still decoding.
        joins_lengths = join_lengths and order == "fifo" and capacity is None and decoder.joins_lengths
        super().__init__(decoder, PoolPlanner(pool_size, eps, refill_unit, capacity, capacity_unit, max_wait,
                                              order, decoder.beam_size, decoder.first_step_rows, decoder.can_join,
                                              joins_lengths, decoder.stats))

    @property
    def joins_lengths(self) -> bool:
        """Whether cohorts at different steps are merged into one (the planner's rule)."""
        return self.planner.joins_lengths
