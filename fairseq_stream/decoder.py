"""Our beam-search loop over fairseq's EnsembleModel, with replaceable search policy.

One batch of sentences is decoded in a dense ``(sentences, k)`` slot layout:
slot ``j`` of sentence ``s`` is row ``s * k + j`` of ``tokens``/``scores``.
A slot is *live* (an unfinished hypothesis that the decoder must extend),
*done* (a finished hypothesis that stays on the beam: ``--finalize stay``) or
empty (pruned away by variable-width search). Only live rows go through the
decoder, except in fairseq-compatible fixed-width search, which runs all
``S * k`` rows (also the ``k - 1`` copies of the start at step 0) so that its
arithmetic is exactly ``SequenceGenerator``'s.

Finalization rules (``--finalize``):

* ``fairseq``: a candidate ending in EOS among the best ``k`` of the ``2k``
  candidates is finalized at once; the next beam is the best ``k`` candidates
  not ending in EOS; a sentence ends with ``k`` finalized hypotheses, at its
  maximum length, or (pruning) when no live hypothesis survives.
* ``stay`` (Yang et al. 2020, App. A.1): finished candidates stay on the
  beam, compete with new expansions by cumulative log-probability and can
  fall off; a sentence ends when no live entry is left on its beam. Its
  output is the finished entries of that final beam, ranked by fairseq's
  length-normalized score (so ``--lenpen`` ranks as in fairseq).

This module assembles a step's three parts for beam search, each of which
the engine (:mod:`~fairseq_stream.engine`) calls through its own interface:
the model call (:meth:`BeamDecoder.call_model`, the decoder's own: the
runner's step, then the output layer's candidates), the search policy
(:attr:`BeamDecoder.policy`, an object of its own:
:mod:`~fairseq_stream.search.policies`, fairseq's or the stay rule's
selection; fixed, var and greedy are these at their k and pruning) and the
bookkeeping (:attr:`BeamDecoder.books`,
:class:`~fairseq_stream.cohort_steps.BeamBookkeeping`: finalization, the
next beam); and the cohort interface. The loop that decides which cohorts step, for ``--generator
batch`` and the streaming pool alike, and calls the three in turn is the
engine's. What the search asks sits beside
it: its runner, output backend and policy come ready
(:mod:`~fairseq_stream.decoder_parts`; ``build.py`` assembles them); a
step's candidates (:mod:`~fairseq_stream.candidates`),
the selection (:mod:`~fairseq_stream.search.selection`, which the policy
calls), the finalization rule (:mod:`~fairseq_stream.finalize`), the
cohort's move to the next beam (:mod:`~fairseq_stream.cohort_steps`), the length rules
(:mod:`~fairseq_stream.lengths`), and the whole search in one compiled call
where that is exact (:mod:`~fairseq_stream.compiled_search`).
"""

import copy
import functools
import time
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from fairseq_stream import compiled_search, decoder_parts, late_reads
from fairseq_stream import hypotheses as hyp
from fairseq_stream import lengths
from fairseq_stream.candidates import candidates, per_row, top_candidates
from fairseq_stream.cohort import Cohort
from fairseq_stream.cohort_steps import BeamBookkeeping, open_cohort, reserve_pool
from fairseq_stream.engine import Engine
from fairseq_stream.errors import FairseqStreamError
from fairseq_stream.finalize import finalizer
from fairseq_stream.inference_mode import decoding, released
from fairseq_stream.ops.output_layer import OutputLayerResult
from fairseq_stream.output_choice import check_output_layer
from fairseq_stream.schedule.plan import BatchPlanner
from fairseq_stream.search.policies import search_policy
from fairseq_stream.search.pruning import Pruning
from fairseq_stream.stats import DecodeStats

def _ngram_blocker(size: int):
    """fairseq's ``--no-repeat-ngram-size`` blocker, or None (0: off)."""
    if size <= 0:
        return None
    from fairseq.ngram_repeat_block import NGramRepeatBlock

    return NGramRepeatBlock(size)


def _since(stats: DecodeStats, t0: float, out) -> float:
    """Seconds since ``t0`` for the step that produced ``out`` (a tensor or a list of them)."""
    if isinstance(out, list):
        out = out[0]
    # CUDA calls return before the GPU is done; the per-step times kept
    # for plots (Figure 2) would otherwise measure only kernel launches.
    if stats.keep_steps and out.is_cuda:
        torch.cuda.synchronize(out.device)
    return time.perf_counter() - t0


def hypothesis_scores(runner, score_dtype, normalize_scores: bool, len_penalty: float, finals: List[float],
                      lens: List[int]) -> Tuple[List[float], List[Tensor]]:
    """Hypothesis scores from cumulative ones: the values on the host (to rank by) and fairseq's 0-d score
    tensors, both as fairseq makes them on ``runner``'s models' device
    (:func:`fairseq_stream.hypotheses.normalized`, :func:`fairseq_stream.hypotheses.score_tensors`)."""
    from fairseq_stream.runners.base import module_device

    device = module_device(runner.model)
    values = hyp.normalized(finals, lens, score_dtype, normalize_scores, len_penalty,
                            reciprocal=device.type == "cuda")
    return values, hyp.score_tensors(values, score_dtype, device)


def check_call(prefix_tokens, constraints):
    """Refuse fairseq ``generate`` arguments our loop does not implement."""
    if prefix_tokens is not None:
        raise FairseqStreamError("--prefix-size is not supported by this --search yet")
    if constraints is not None:
        raise FairseqStreamError("--constraints is not supported by this --search")


class BeamDecoder:
    """A fairseq generator (``generate(models, sample, ...)``) running our beam search through the engine.

    Schedulers drive it a step at a time through its stepping interface
    (:class:`~fairseq_stream.engine.CohortDecoder`): :meth:`open` a
    batch into a cohort, step cohorts by one decoder call (:meth:`call_model`, then each cohort's
    search step by its :attr:`policy` and bookkeeping by its :attr:`books`, two objects of their own),
    :meth:`split` and :meth:`join` them (:meth:`can_join`,
    :attr:`joins_lengths`, :attr:`first_step_rows`).

    Args:
        models: list of fairseq models (ensemble).
        tgt_dict: target dictionary.
        beam_size: k, the maximum beam width.
        finalize: ``fairseq`` or ``stay`` (see module docstring).
        pruning: variable-width heuristics (off by default: fixed width).
        stats: counters to add to (a new one if None).
        max_len_a, max_len_b, min_len, normalize_scores, len_penalty,
        unk_penalty, temperature, no_repeat_ngram_size: as fairseq's
            ``SequenceGenerator``.
        runner: a ready runner (``build.py`` hands one) or its name;
        output_backend: the ready output backend (with a ready runner), or
            None: chosen from ``output_layer``. The names (``runner``,
            ``output_layer``, ``keep_reference``, ``rnn_options``,
            ``quantize``, ``stack_members``): see :mod:`fairseq_stream.decoder_parts`.
        host_lag: read each step's summary this many decoder calls late (:mod:`.late_reads`); 0: at once.
        policy: the ready search policy of ``beam_size``, ``finalize`` and
            ``pruning`` (``build.py`` hands one: :func:`.decoder_parts.policy`),
            or None: made from them the same way.
    """

    def __init__(self, models, tgt_dict, beam_size: int = 5, finalize: str = "fairseq",
                 pruning: Optional[Pruning] = None, stats: Optional[DecodeStats] = None, max_len_a: float = 0,
                 max_len_b: int = 200, min_len: int = 1, normalize_scores: bool = True, len_penalty: float = 1.0,
                 unk_penalty: float = 0.0, temperature: float = 1.0, no_repeat_ngram_size: int = 0,
                 runner="fairseq", output_layer: str = "torch", keep_reference: Optional[bool] = None,
                 rnn_options=None, quantize: str = "none", stack_members: Optional[bool] = None,
                 output_backend: Optional[str] = None, host_lag: int = 0, policy=None):
        decoder_parts.check_rules(finalize, temperature)
        self.dense = decoder_parts.is_dense(finalize, pruning)
        self.keep_reference = decoder_parts.keeps_reference(finalize, pruning, keep_reference)
        if isinstance(runner, str):  # names (tests, benchmarks): the parts as build.py makes them
            runner, output_backend = decoder_parts.parts(
                models, tgt_dict, beam_size, finalize, pruning, temperature, no_repeat_ngram_size, runner,
                output_layer, keep_reference, rnn_options, quantize, stack_members)
        self.runner, self.output_backend = runner, output_backend
        # Scores accumulate in the models' precision where it is float64
        # (exactness tests), in float32 otherwise (fairseq's log-softmax dtype).
        self.score_dtype = torch.float64 if self.runner.dtype == torch.float64 else torch.float32
        self.tgt_dict = tgt_dict
        self.pad, self.unk, self.eos = tgt_dict.pad(), tgt_dict.unk(), tgt_dict.eos()
        self.vocab_size = len(tgt_dict)
        self.beam_size = decoder_parts.beam_width(beam_size, self.vocab_size)
        self.finalize = finalize
        self.finalizer = finalizer(finalize, self.beam_size, self.eos)
        self.pruning = pruning or Pruning()
        self.policy = policy if policy is not None else decoder_parts.policy(tgt_dict, beam_size, finalize, pruning)
        self.stats = stats if stats is not None else DecodeStats()
        self.max_len_a, self.max_len_b = max_len_a, max_len_b
        self.min_len = min_len
        # An int: fairseq's LSTM reports a float (1e5), which made max_lengths() float.
        self.max_len = int(min(self.runner.max_decoder_positions(), 2 ** 62))
        self.shortest_max_len = self._shortest_max_len()
        self.normalize_scores, self.len_penalty = normalize_scores, len_penalty
        self.unk_penalty, self.temperature = unk_penalty, temperature
        self.symbols_to_strip_from_output = {self.eos}
        self._warned_cap = False
        self.repeat_ngram_blocker = _ngram_blocker(no_repeat_ngram_size)
        self.output_layer = check_output_layer(output_layer)
        self.no_repeat_ngram_size = no_repeat_ngram_size
        if self.output_backend is None:
            self.output_backend = self._output_backend()
        # The search runs in one compiled call where it can (compiled_search.py);
        # False keeps the Python loop (the reference the tests compare it with).
        self.compiled_loop = True
        self.host_lag = host_lag
        self.late = late_reads.reader(host_lag, self.dense, getattr(self.runner, "name", None))
        self.books = self._bookkeeping()

    def with_lengths(self, max_len_a: float, max_len_b: int, min_len: int) -> "BeamDecoder":
        """A copy sharing the runner and its weights, with other length rules and counters of its own
        (Jacobi's calibration times decodes of a forced length with it)."""
        probe = copy.copy(self)
        probe.max_len_a, probe.max_len_b, probe.min_len = max_len_a, max_len_b, min_len
        probe.shortest_max_len = probe._shortest_max_len()
        probe.stats = DecodeStats()
        probe.books = probe._bookkeeping()  # its counters are the late reader's clock
        return probe

    def _bookkeeping(self) -> BeamBookkeeping:
        """The bookkeeping of this decoder's steps: its finalizer, runner, scorer, counters and late reader."""
        # The scorer holds the runner and the rules, not the decoder: no reference cycle keeps a decoder alive.
        scorer = functools.partial(hypothesis_scores, self.runner, self.score_dtype, self.normalize_scores,
                                   self.len_penalty)
        return BeamBookkeeping(self.beam_size, self.dense, self.runner, self.finalizer, scorer, self.stats, self.late)

    def cuda(self):
        self.runner.cuda()
        self.output_backend = self._output_backend()  # the kernel follows the models' device
        return self

    @property
    def candidates_per_row(self) -> int:
        """How many candidates each decoder row contributes to its sentence's selection (fused layer):
        :func:`fairseq_stream.candidates.per_row`."""
        return per_row(self.beam_size, self.vocab_size, self.finalize, self.pruning.active)

    def _output_backend(self) -> str:
        """The output backend for this decoder's runner on its models' device (:mod:`.decoder_parts`)."""
        return decoder_parts.output_backend(self.runner, self.output_layer, self.keep_reference,
                                            self.candidates_per_row, self.no_repeat_ngram_size)

    def generate(self, models, sample, prefix_tokens=None, constraints=None, bos_token=None, **kwargs):
        """Translate a fairseq sample; one list of hypotheses per sentence, in sample order."""
        self.check_call(prefix_tokens, constraints)
        start = time.perf_counter()
        with decoding():
            results = self._search_in_one_call(sample["net_input"], bos_token)
            if results is None:
                # The engine's loop with the batch planner: the one cohort stepped until it is empty.
                cohort = self.open(sample["net_input"], bos_token=bos_token)
                results = dict(Engine(self, BatchPlanner()).run([cohort]))
        self.stats.add_sentences(len(results), time.perf_counter() - start, results.values())
        return [released(results[i]) for i in range(len(results))]

    def _search_in_one_call(self, net_input, bos_token) -> Optional[Dict[int, List[Dict[str, Tensor]]]]:
        """The batch's search in one compiled call where :mod:`fairseq_stream.compiled_search` applies, else None
        (the Python loop runs)."""
        if self.late is not None or not compiled_search.applies(self, net_input["src_tokens"]):
            return None
        return compiled_search.search(self, net_input, bos_token)

    check_call = staticmethod(check_call)

    def max_lengths(self, src_tokens: Tensor) -> Tensor:
        """Each sentence's maximum output length, as fairseq computes it for this batch (:mod:`.lengths`)."""
        max_lens, self._warned_cap = lengths.max_lengths(src_tokens, self.max_len_a, self.max_len_b, self.min_len,
                                                         self.max_len, self._warned_cap)
        return max_lens

    # -- the cohort interface and a step's parts ------------------------------

    def open(self, net_input, ids: Optional[Tensor] = None, bos_token=None) -> Cohort:
        """Encode a fairseq batch into a cohort at step 0; ``ids`` name its sentences (default 0..S-1)."""
        return open_cohort(self, net_input, ids, bos_token)

    reserve_pool = reserve_pool  # the runner's memory sized at a decode's first batch (Engine._reserve)

    @property
    def joins_lengths(self) -> bool:
        """Whether cohorts at different steps may join into one (:meth:`Cohort.merge`).

        The runner must hold rows of different lengths in one state; the
        n-gram blocker reads prefixes from column 0, so it keeps cohorts at
        one length.
        """
        return bool(getattr(self.runner, "joins_lengths", False)) and self.repeat_ngram_blocker is None

    def can_join(self, c: Cohort) -> bool:
        """Whether ``c`` may join a cohort at another step: every sentence past its first step and ``--min-len``.

        A first step extends one slot of each beam (all hold the start), and
        below ``--min-len`` EOS is banned: both are decided for a whole
        cohort by its step. Asked only where :attr:`joins_lengths` holds.
        """
        return c.mixed or c.step >= max(1, self.min_len)

    @property
    def first_step_rows(self) -> int:
        """Decoder rows a new sentence runs at its first step: k where every slot is a row (dense), else 1."""
        return self.beam_size if self.dense else 1

    def split(self, c: Cohort, n: int) -> Tuple[Cohort, Cohort]:
        """``c``'s first ``n`` sentences and the rest, as two cohorts with their decoder states."""
        idx = torch.arange(c.size, device=c.ids.device)
        first = c.select(self.runner, idx[:n], list(range(n)))
        return first, c.select(self.runner, idx[n:], list(range(n, c.size)))

    def join(self, cohorts: List[Cohort], any_length: bool = False) -> Cohort:
        """One cohort of ``cohorts``, sentences in order: all at one step, or (``any_length``) at any step.

        ``any_length`` needs :attr:`joins_lengths` and cohorts that
        :meth:`can_join` (:meth:`Cohort.merge`); the joined cohort's
        sentences keep their own lengths.
        """
        if any_length:
            return Cohort.merge(self.runner, cohorts)
        return Cohort.concat(self.runner, cohorts)

    def call_model(self, cohorts: List[Cohort]) -> List[tuple]:
        """The plan's model call (:class:`~fairseq_stream.engine.StepModel`): one runner call over ``cohorts``'
        run rows, then the output layer. Returns each cohort's candidates, ``(cand, local, word_of, per_slot)``
        (:func:`fairseq_stream.candidates.candidates`)."""
        t0 = time.perf_counter()
        out = self._run_rows(cohorts)
        rows = sum(c.rows for c in cohorts)
        self.stats.add_step(max(c.longest for c in cohorts) + 1, rows, _since(self.stats, t0, out))
        if len(cohorts) == 1:
            return [self._candidates(cohorts[0], out)]
        found, start = [], 0
        for c in cohorts:
            end = start + c.rows
            found.append(self._candidates(c, [x[start:end] for x in out] if self.fused else out[start:end]))
            start = end
        return found

    def _run_rows(self, cohorts: List[Cohort]):
        """The runner's one step over the cohorts' run rows: the ensemble's log-probabilities (rows, V), or
        under the fused output layer each model's logits (positional: wrappers in tests pass *args)."""
        if len(cohorts) == 1:
            c = cohorts[0]
            # Dense: the run rows are every row, in order; a view, not a gather of every prefix.
            if c.mixed:
                # Each row at its own length: the runner needs only the last tokens.
                last = c.tokens[:, c.step] if self.dense else c.tokens[c.run_rows, c.step]
                return self.runner.step_own([c.state], last.unsqueeze(1), self.fused)[0]
            prefixes = c.tokens[:, : c.step + 1] if self.dense else c.tokens[c.run_rows, : c.step + 1]
            return self.runner.step(c.state, prefixes, self.fused)[0]
        # Cohorts of different lengths in one call (VAR-STR-FIFO).
        last = torch.cat([c.tokens[c.run_rows, c.step] for c in cohorts]).unsqueeze(1)
        if any(c.mixed for c in cohorts):
            return self.runner.step_own([c.state for c in cohorts], last, self.fused)[0]
        return self.runner.step_mixed([c.state for c in cohorts], last, [c.step + 1 for c in cohorts],
                                      self.fused)[0]

    @property
    def fused(self) -> bool:
        """Whether steps go through the fused output layer (the runner then returns logits)."""
        return self.output_backend != "torch"

    def select(self, c: Cohort, found: tuple):
        """``c``'s search step over its candidates ``found``: its :attr:`policy`'s (the engine calls the policy
        itself; the decoder as a whole is still a :class:`~fairseq_stream.engine.SearchPolicy`)."""
        return self.policy.select(c, found)

    def update(self, c: Cohort, step_out) -> Dict[int, List[Dict[str, Tensor]]]:
        """The bookkeeping of ``c``'s search step ``step_out``, in place: its :attr:`books`' (the engine calls
        them itself; the decoder as a whole is still a :class:`~fairseq_stream.engine.Bookkeeping`)."""
        return self.books.update(c, step_out)

    def _candidates(self, c: Cohort, lprobs):
        """(cand, local, word_of, per_slot) of ``c``'s step: :func:`fairseq_stream.candidates.candidates`."""
        return candidates(self, c, lprobs)

    def top_candidates(self, logits, n: int, ban_eos=None, force_eos: Optional[Tensor] = None,
                       check: bool = True) -> OutputLayerResult:
        """Each row's ``n`` best words from the models' ``logits`` by this decoder's rules and output backend
        (:func:`fairseq_stream.candidates.top_candidates`; Jacobi's windows use it too)."""
        return top_candidates(self, logits, n, ban_eos, force_eos, check)

    def _shortest_max_len(self) -> int:
        """A lower bound on every sentence's maximum length, known on the host (:mod:`.lengths`)."""
        return lengths.shortest_max_len(self.max_len_a, self.max_len_b, self.max_len)

    # -- scoring (the finalizer's scorer; Jacobi's too) ---------------------

    def scores(self, finals: List[float], lens: List[int]) -> Tuple[List[float], List[Tensor]]:
        """This search's hypothesis scores from cumulative ones: :func:`hypothesis_scores` by its rules."""
        return hypothesis_scores(self.runner, self.score_dtype, self.normalize_scores, self.len_penalty, finals, lens)

    def empty_hypothesis(self, device) -> Dict[str, Tensor]:
        """The hypothesis of an empty source."""
        return hyp.empty_hypothesis(self.eos, device)
