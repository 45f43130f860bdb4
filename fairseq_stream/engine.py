"""The engine: the one Python decoding loop, which owns the cohorts and executes a planner's plans.

vLLM's shape (``vllm/v1/engine/core.py``: ``EngineCore.step`` asks
``scheduler.schedule()`` for a ``SchedulerOutput``, has the model executor
run it, and hands the output back through
``scheduler.update_from_output``). Here :meth:`Engine.run` asks its
:class:`Planner` what to do with the cohorts it holds (admit sentences,
join, split, which cohorts the next decoder call runs), carries the cohort
moves out through the decoder's cohort interface (:class:`CohortDecoder`:
``open`` happens before, then ``split``, ``join``), runs the plan phase by
phase (:meth:`Engine.step`) and hands the call back
(``update_from_output``). It yields each sentence's hypotheses as the
sentence finishes.

A plan's step calls three parts, each through its own declared interface:

* the model call (:class:`StepModel`: the runner's step over the plan's
  rows, then the output layer), which returns each cohort's candidates;
* the search policy (:class:`SearchPolicy`), a cohort's step from its
  candidates to the survivors and the finished: fairseq's ``Search.step``
  (``fairseq/search.py``), CTranslate2's ``SearchStrategy::search``
  (``include/ctranslate2/decoding.h``) with the model behind
  ``decoder(step, ids, state)``; fixed, var and greedy (fixed at k = 1) are
  the two rules' policies (:mod:`fairseq_stream.search.policies`) at their
  k and pruning;
* the bookkeeping (:class:`Bookkeeping`): the finished sentences'
  hypotheses, and the cohort moved to its next beam.

The engine is handed them by a :class:`CohortSteps`: the model call is its
own, the policy and the bookkeeping are objects of their own
(``policy``, ``books``). :class:`~fairseq_stream.decoder.BeamDecoder` is
the assembly for beam search (its policy from
:mod:`~fairseq_stream.search.policies`, its bookkeeping
:class:`~fairseq_stream.cohort_steps.BeamBookkeeping`); Jacobi's window
steps (:class:`~fairseq_stream.jacobi.decoder.JacobiDecoder`'s) are the
assembly for its windows: the window call its model call, greedy's
acceptance of the verified tokens its policy.

Two planners drive it, so the search loop is written once:

* the streaming pool's (:class:`~fairseq_stream.schedule.plan.PoolPlanner`:
  refill at ε, shortest first or FIFO, the capacity, the latency guard),
  as :class:`~fairseq_stream.schedule.pool.StreamPool`;
* the batch path's (:class:`~fairseq_stream.schedule.plan.BatchPlanner`: one
  batch admitted whole and stepped until every sentence finished), in
  :meth:`~fairseq_stream.decoder.BeamDecoder.generate` and in Jacobi's
  :meth:`~fairseq_stream.jacobi.decoder.JacobiDecoder.decode` (a window call
  a step).

A planner changes when work is done, never what is decoded: every sentence
goes through the same search steps whichever planner runs it. The whole
batch's search in one compiled call (:mod:`~fairseq_stream.compiled_search`)
is another path, chosen before the engine runs.
"""

from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Protocol, Tuple, Union, runtime_checkable

from torch import Tensor

from fairseq_stream.cohort import Cohort
from fairseq_stream.schedule.plan import Join, StepPlan
from fairseq_stream.stats import DecodeStats

Finished = Dict[int, List[dict]]  # sentence id -> its hypotheses, best first


@runtime_checkable
class StepModel(Protocol):
    """The model call of a plan: the runner's step over its cohorts' rows, then the output layer."""

    def call_model(self, cohorts: List[Any]) -> List[Any]:
        """One runner call over ``cohorts`` and the output layer: each cohort's candidates, in order."""


@runtime_checkable
class SearchPolicy(Protocol):
    """A cohort's search step: from its candidates to the survivors and the finished (fairseq's ``Search.step``)."""

    def select(self, c: Any, candidates: Any) -> Any:
        """``c``'s selection over ``candidates`` (what :class:`Bookkeeping` settles)."""


@runtime_checkable
class Bookkeeping(Protocol):
    """What follows a search step: the finished sentences' hypotheses, the cohort moved to its next beam."""

    def update(self, c: Any, chosen: Any) -> Finished:
        """Carry ``c``'s selection ``chosen`` out, in place; the sentences that finished leave ``c``."""


@runtime_checkable
class CohortSteps(StepModel, Protocol):
    """The three parts of a step, all that the engine needs under a planner that never splits or joins: the
    model call (this object's :meth:`call_model`), and the search policy and the bookkeeping, each an object of
    its own."""

    policy: SearchPolicy
    books: Bookkeeping


@runtime_checkable
class CohortDecoder(CohortSteps, Protocol):
    """The stepping interface: all that the engine, the schedulers and the API use of a decoder.

    :class:`~fairseq_stream.decoder.BeamDecoder` is the one implementation.
    The decoder opens a fairseq batch into a cohort at step 0, splits and
    joins cohorts, and hands the engine the three parts of a step (:class:`CohortSteps`);
    the caller decides which cohorts run and when, and never reaches the
    decoder's runner. ``generate``, ``eos``, ``symbols_to_strip_from_output``,
    ``cuda`` and ``check_call`` are fairseq's generator interface, which a
    scheduler wrapping the decoder passes on.
    """

    stats: DecodeStats  # the run's counters; the pool adds its refills and lags
    policy: SearchPolicy  # as CohortSteps declares: named here, where the schedulers' reads are checked
    books: Bookkeeping
    beam_size: int  # k: the most slots a sentence holds
    eos: int
    symbols_to_strip_from_output: set

    @property
    def first_step_rows(self) -> int:
        """Decoder rows a new sentence runs at its first step (k or 1)."""

    @property
    def joins_lengths(self) -> bool:
        """Whether cohorts at different steps may join into one (:meth:`join` with ``any_length``)."""

    def open(self, net_input, ids: Optional[Tensor] = None, bos_token=None) -> Cohort:
        """Encode a fairseq batch into a cohort at step 0."""

    def split(self, c: Cohort, n: int) -> Tuple[Cohort, Cohort]:
        """``c``'s first ``n`` sentences and the rest."""

    def join(self, cohorts: List[Cohort], any_length: bool = False) -> Cohort:
        """One cohort of ``cohorts``: at one step, or at any (``any_length``)."""

    def can_join(self, c: Cohort) -> bool:
        """Whether ``c`` may join a cohort at another step."""

    def generate(self, models, sample, prefix_tokens=None, constraints=None, bos_token=None, **kwargs):
        """fairseq's ``generate``: one list of hypotheses per sentence of ``sample``."""

    def check_call(self, prefix_tokens, constraints):
        """Refuse fairseq ``generate`` arguments the decoder does not implement."""

    def cuda(self):
        """Move the decoder to the GPU; returns it."""


class Planner(Protocol):
    """What the engine asks of a scheduler: decisions over cohorts (sizes, steps, rows), never a model call."""

    def active(self, cohorts: List[Cohort]) -> int:
        """What the refill decision counts of ``cohorts`` (sentences or rows)."""

    def should_refill(self, cohorts: List[Cohort]) -> bool:
        """Whether to admit sentences before the next call."""

    def refill_need(self, cohorts: List[Cohort]) -> int:
        """How many sentences to admit (the engine splits an encoded batch to take that many)."""

    def admit(self, cohorts: List[Cohort]):
        """``cohorts`` enter now."""

    def joins(self, cohorts: List[Cohort]) -> List[Union[Cohort, Join]]:
        """The cohorts after joining: each a :class:`~fairseq_stream.schedule.plan.Join` or a cohort kept."""

    def joined(self, merged: Cohort, join: Join):
        """``join`` made ``merged``."""

    def schedule(self, cohorts: List[Cohort]) -> StepPlan:
        """The next decoder call."""

    def update_from_output(self, plan: StepPlan):
        """The call of ``plan`` ran."""

    def held(self, batch: int, ahead: int) -> Tuple[int, int]:
        """The most sentences held at once (admitted, staged, encoded ``ahead`` batches of ``batch``), and the
        most copied at once beside them (a split copies both parts before the whole is collected)."""


class Engine:
    """The decoding loop: ``planner`` decides, the engine executes through ``decoder`` and feeds results back.

    Args:
        decoder: a :class:`CohortDecoder` (a
            :class:`~fairseq_stream.decoder.BeamDecoder`: its parts and
            statistics are used as they are); under a planner that never
            splits or joins, any :class:`CohortSteps` (Jacobi's window steps).
        planner: a :class:`Planner`.
    """

    def __init__(self, decoder: CohortSteps, planner: Planner):
        self.decoder, self.planner = decoder, planner
        # A step's three parts, each reached through its own interface only. The model call is the decoder's
        # own: its candidates read the decoder's length rules, which with_lengths copies.
        self.model: StepModel = decoder
        self.policy: SearchPolicy = decoder.policy
        self.books: Bookkeeping = decoder.books
        self.peak_sentences = 0  # most sentences held at once, encoded ones waiting included
        self.encoded_ahead = 0  # batches the input encodes ahead of the pool (its read-ahead queue)
        self.longest_source: Optional[int] = None  # the input's longest source, where known (fairseq-generate's)

    def run(self, batches: Iterable[Cohort], may_read: Optional[Callable[[], bool]] = None
            ) -> Iterator[Tuple[int, List[dict]]]:
        """Yield ``(sentence id, hypotheses)`` as sentences finish; each id exactly once.

        Args:
            batches: encoded batches, each a cohort at step 0 (see
                :meth:`BeamDecoder.open`), pulled only when the planner admits sentences.
            may_read: asked before pulling a batch; False holds the input back
                while the engine still has sentences to decode.
        """
        source = iter(batches)
        self._reserved = False
        staging: List[Cohort] = []
        cohorts: List[Cohort] = []
        exhausted = False
        while True:
            if not exhausted and self._should_refill(cohorts):
                hold = may_read is not None and bool(cohorts) and not may_read()
                exhausted, _ = self._refill(source, staging, cohorts, hold)
                held = sum(c.size for c in cohorts) + sum(c.size for c in staging)
                self.peak_sentences = max(self.peak_sentences, held)
            if not cohorts:
                if exhausted and not staging:
                    return
                continue
            plan = self.planner.schedule(cohorts)
            finished = self.step(self._split(cohorts, plan))
            self.planner.update_from_output(plan)
            for sid, hyps in finished.items():
                yield sid, hyps
            cohorts = [c for c in cohorts if c.size]
            cohorts = self._join(cohorts)

    def step(self, run: List[Cohort]) -> Finished:
        """One plan's call, phase by phase: the model call over ``run``'s rows, then each cohort's search step
        and its bookkeeping. Returns the sentences that finished (they have left their cohorts)."""
        finished: Finished = {}
        # One model call serves every cohort of the plan (the streaming paper's
        # VAR-STR-FIFO: cohorts at different lengths in one call); the search
        # and its bookkeeping are each cohort's own.
        for c, candidates in zip(run, self.model.call_model(run)):
            chosen = self.policy.select(c, candidates)
            finished.update(self.books.update(c, chosen))
        return finished

    # -- executing the planner's decisions -------------------------------------

    def _active(self, cohorts) -> int:
        return self.planner.active(cohorts)

    def _should_refill(self, cohorts) -> bool:
        return self.planner.should_refill(cohorts)

    def _refill(self, source, staging: List[Cohort], cohorts: List[Cohort], hold: bool = False):
        """Admit the sentences the planner asks for (``hold``: only from ``staging``).

        Returns (the source is exhausted and nothing is staged, sentences admitted).
        """
        need = self.planner.refill_need(cohorts)
        admitted: List[Cohort] = []
        exhausted = False
        while need > 0:
            if not staging:
                if hold:
                    break
                batch = next(source, None)
                if batch is None:
                    exhausted = True
                    break
                if batch.size == 0:
                    continue
                if not self._reserved:
                    self._reserve(batch)
                staging.append(batch)
            head = staging[0]
            if head.size <= need:
                admitted.append(staging.pop(0))
                need -= head.size
            else:
                # Keep the batch encoded as a whole (the encoder sees fairseq's
                # batch) and admit its first sentences.
                first, staging[0] = self.decoder.split(head, need)
                admitted.append(first)
                need = 0
        self.planner.admit(admitted)
        if admitted:
            cohorts.extend(admitted)
            cohorts[:] = self._join(cohorts)
        return exhausted and not staging, sum(c.size for c in admitted)

    def _reserve(self, first: Cohort):
        """The decoder's memory sized once for this run, from its first batch and what the planner holds at
        once (the static-slot runner's pool: it must not grow under a captured step)."""
        self._reserved = True
        reserve = getattr(self.decoder, "reserve_pool", None)
        if reserve is not None:
            reserve(first, *self.planner.held(first.size, self.encoded_ahead), self.longest_source)

    def _split(self, cohorts: List[Cohort], plan: StepPlan) -> List[Cohort]:
        """The cohorts ``plan`` runs: where it splits one, its first part (the rest takes its place after it)."""
        if plan.split is None:
            return plan.run
        (chosen,) = plan.run
        first, rest = self.decoder.split(chosen, plan.split)
        position = next(i for i, c in enumerate(cohorts) if c is chosen)
        cohorts[position:position + 1] = [first, rest]
        return [first]

    def _join(self, cohorts: List[Cohort]) -> List[Cohort]:
        """The planner's joins made by the decoder."""
        joined = []
        for entry in self.planner.joins(cohorts):
            if isinstance(entry, Join):
                merged = self.decoder.join(entry.cohorts, any_length=True) if entry.any_length \
                    else self.decoder.join(entry.cohorts)
                self.planner.joined(merged, entry)
                joined.append(merged)
            else:
                joined.append(entry)
        return joined
