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
"""

import copy
import logging
import math
import struct
import time
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from fairseq_stream import compiled_search
from fairseq_stream import hypotheses as hyp
from fairseq_stream.cohort import Cohort
from fairseq_stream.errors import FairseqStreamError
from fairseq_stream.finalize import finalizer, read_host
from fairseq_stream.inference_mode import decoding, released
from fairseq_stream.ops import topk_log_softmax
from fairseq_stream.ops.output_layer import OutputLayerResult, apply_step_rules
from fairseq_stream.output_choice import check_output_layer, choose_backend
from fairseq_stream.runners import build_runner
from fairseq_stream.search.pruning import Pruning
from fairseq_stream.ops.beam_step import reorder_beam_
from fairseq_stream.ops.packing import compact
from fairseq_stream.search.selection import fairseq_step, forced_eos_ranks, stay_step
from fairseq_stream.stats import DecodeStats

logger = logging.getLogger(__name__)

FINALIZE_MODES = ("fairseq", "stay")


def _check_rules(finalize: str, temperature: float):
    """One-line errors for a finalization rule or temperature the loop does not take."""
    if finalize not in FINALIZE_MODES:
        raise FairseqStreamError(
            "--finalize must be one of {}, got {}".format(", ".join(FINALIZE_MODES), finalize)
        )
    if temperature <= 0:
        raise FairseqStreamError("--temperature must be greater than 0")


def _ngram_blocker(size: int):
    """fairseq's ``--no-repeat-ngram-size`` blocker, or None (0: off)."""
    if size <= 0:
        return None
    from fairseq.ngram_repeat_block import NGramRepeatBlock

    return NGramRepeatBlock(size)


class BeamDecoder:
    """A fairseq generator (``generate(models, sample, ...)``) running our beam loop.

    Schedulers drive it a step at a time through its stepping interface
    (:class:`~fairseq_stream.schedule.pool.CohortDecoder`): :meth:`open` a
    batch into a cohort, :meth:`advance_together` cohorts by one decoder call,
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
        runner: ``fairseq`` (the reference), ``lean``, ``rnn`` or ``auto``;
            see :func:`fairseq_stream.runners.build_runner`.
        output_layer: ``torch`` (the reference), ``fused`` or ``auto``; see
            :mod:`fairseq_stream.output_choice`.
        keep_reference: ``auto`` runner and output layer stay on the
            references (fairseq, torch); default: when the search is dense
            (fixed width, ``--finalize fairseq``), whose promise is bitwise
            identity with fairseq's SequenceGenerator. The promise needs
            fairseq's runner: on another one (asked for by ``runner``), the
            ``auto`` output layer is the fused one.
        rnn_options: the rnn runner's tricks
            (:class:`~fairseq_stream.runners.rnn.RnnOptions`; default: all on,
            int16 off).
        quantize: ``none``, ``int8`` (``int8w8``, ``int8w7``) or ``int16`` (``--quantize``): the
            products on weights quantized at load; see
            :func:`fairseq_stream.runners.build_runner`.
        stack_members: the lean runner stacks an ensemble's members of one
            shape (:mod:`fairseq_stream.runners.stacked`) where True, steps
            them one after another where False; None (``--stack-members
            auto``) stacks where their step is not compiled.
    """

    def __init__(self, models, tgt_dict, beam_size: int = 5, finalize: str = "fairseq",
                 pruning: Optional[Pruning] = None, stats: Optional[DecodeStats] = None, max_len_a: float = 0,
                 max_len_b: int = 200, min_len: int = 1, normalize_scores: bool = True, len_penalty: float = 1.0,
                 unk_penalty: float = 0.0, temperature: float = 1.0, no_repeat_ngram_size: int = 0,
                 runner: str = "fairseq", output_layer: str = "torch", keep_reference: Optional[bool] = None,
                 rnn_options=None, quantize: str = "none",
                 stack_members: Optional[bool] = None):
        _check_rules(finalize, temperature)
        # fairseq's exact arithmetic: every slot is a decoder row, as in SequenceGenerator.
        self.dense = finalize == "fairseq" and not (pruning is not None and pruning.active)
        self.keep_reference = self.dense if keep_reference is None else keep_reference
        self.runner = build_runner(runner, models, temperature=temperature, keep_fairseq=self.keep_reference,
                                   rnn_options=rnn_options, quantize=quantize, stack_members=stack_members)
        # Scores accumulate in the models' precision where it is float64
        # (exactness tests), in float32 otherwise (fairseq's log-softmax dtype).
        self.score_dtype = torch.float64 if self.runner.dtype == torch.float64 else torch.float32
        self.tgt_dict = tgt_dict
        self.pad, self.unk, self.eos = tgt_dict.pad(), tgt_dict.unk(), tgt_dict.eos()
        self.vocab_size = len(tgt_dict)
        self.beam_size = min(beam_size, self.vocab_size - 1)
        self.finalize = finalize
        self.finalizer = finalizer(finalize, self.beam_size, self.eos)
        self.pruning = pruning or Pruning()
        self.stats = stats if stats is not None else DecodeStats()
        self.max_len_a, self.max_len_b = max_len_a, max_len_b
        self.min_len = min_len
        # An int: fairseq's LSTM reports a float (1e5), which made max_lengths() float.
        self.max_len = int(min(self.runner.max_decoder_positions(), 2 ** 62))
        self.shortest_max_len = self._shortest_max_len()
        self.normalize_scores = normalize_scores
        self.len_penalty = len_penalty
        self.unk_penalty = unk_penalty
        self.temperature = temperature
        self.symbols_to_strip_from_output = {self.eos}
        self._warned_cap = False
        self.repeat_ngram_blocker = _ngram_blocker(no_repeat_ngram_size)
        self.output_layer = check_output_layer(output_layer)
        self.no_repeat_ngram_size = no_repeat_ngram_size
        self.output_backend = self._output_backend()
        # The search runs in one compiled call where it can (compiled_search.py);
        # False keeps the Python loop (the reference the tests compare it with).
        self.compiled_loop = True

    def with_lengths(self, max_len_a: float, max_len_b: int, min_len: int) -> "BeamDecoder":
        """A copy sharing the runner and its weights, with other length rules and counters of its own
        (Jacobi's calibration times decodes of a forced length with it)."""
        probe = copy.copy(self)
        probe.max_len_a, probe.max_len_b, probe.min_len = max_len_a, max_len_b, min_len
        probe.shortest_max_len = probe._shortest_max_len()
        probe.stats = DecodeStats()
        return probe

    def cuda(self):
        self.runner.cuda()
        self.output_backend = self._output_backend()  # the kernel follows the models' device
        return self

    @property
    def candidates_per_row(self) -> int:
        """How many candidates each decoder row contributes to its sentence's selection (fused layer).

        A sentence's best k (``stay``) or 2k (``fairseq``) candidates are
        among its rows' best k (2k). Greedy (k = 1, no pruning) needs only
        the best: if it ends in EOS the sentence has its one hypothesis and
        ends, else it is the next token.
        """
        k, V = self.beam_size, self.vocab_size
        if self.finalize == "stay":
            return min(k, V)
        if k == 1 and not self.pruning.active:
            return 1
        return min(2 * k, V)

    def _output_backend(self) -> str:
        from fairseq_stream.runners.base import module_device
        from fairseq_stream.runners.fairseq_runner import ModelRunner

        device = module_device(self.runner.model)
        # Bitwise fairseq needs fairseq's runner and output layer together: without the one, the other
        # keeps nothing.
        bitwise = self.keep_reference and isinstance(self.runner, ModelRunner)
        return choose_backend(self.output_layer, self.runner, device, self.candidates_per_row,
                              keep_reference=bitwise,
                              no_repeat_ngram_size=self.no_repeat_ngram_size)

    def generate(self, models, sample, prefix_tokens=None, constraints=None, bos_token=None, **kwargs):
        """Translate a fairseq sample; one list of hypotheses per sentence, in sample order."""
        self.check_call(prefix_tokens, constraints)
        start = time.perf_counter()
        with decoding():
            results = self._search_in_one_call(sample["net_input"], bos_token)
            if results is None:
                cohort = self.open(sample["net_input"], bos_token=bos_token)
                results = {}
                while cohort.size:
                    results.update(self.advance(cohort))
        self.stats.add_sentences(len(results), time.perf_counter() - start)
        return [released(results[i]) for i in range(len(results))]

    def _search_in_one_call(self, net_input, bos_token) -> Optional[Dict[int, List[Dict[str, Tensor]]]]:
        """The batch's search in one compiled call where :mod:`fairseq_stream.compiled_search` applies, else None
        (the Python loop runs)."""
        if not compiled_search.applies(self, net_input["src_tokens"]):
            return None
        return compiled_search.search(self, net_input, bos_token)

    @staticmethod
    def check_call(prefix_tokens, constraints):
        """Refuse fairseq ``generate`` arguments our loop does not implement."""
        if prefix_tokens is not None:
            raise FairseqStreamError("--prefix-size is not supported by this --search yet")
        if constraints is not None:
            raise FairseqStreamError("--constraints is not supported by this --search")

    def max_lengths(self, src_tokens: Tensor) -> Tensor:
        """Each sentence's maximum output length, as fairseq computes it for this batch."""
        # fairseq bounds the length by the batch's padded source length.
        max_lens = torch.full((src_tokens.size(0),), src_tokens.size(1), dtype=torch.long,
                              device=src_tokens.device)
        max_lens = (max_lens.float() * self.max_len_a + self.max_len_b).long()
        capped = int(max_lens.gt(self.max_len - 1).sum())
        if capped and not self._warned_cap:
            # fairseq caps silently; say so once, since it can truncate translations.
            logger.warning(
                "fairseq-stream: --max-len-a/-b allow longer outputs than the model's %d "
                "positions; outputs are capped at %d tokens", self.max_len, self.max_len - 1)
            self._warned_cap = True
        max_lens = max_lens.clamp(max=self.max_len - 1)
        if (max_lens < self.min_len).any():
            raise FairseqStreamError("--min-len is larger than the maximum length; adjust --max-len-a/-b")
        return max_lens

    # -- the loop ----------------------------------------------------------

    def open(self, net_input, ids: Optional[Tensor] = None, bos_token=None) -> Cohort:
        """Encode a fairseq batch into a cohort at step 0; ``ids`` name its sentences (default 0..S-1)."""
        src_tokens = net_input["src_tokens"]
        device = src_tokens.device
        k = self.beam_size
        S0 = src_tokens.size(0)
        if ids is None:
            ids = torch.arange(S0, device=device)
        src_lengths = (src_tokens.ne(self.eos) & src_tokens.ne(self.pad)).long().sum(dim=1)
        max_lens = self.max_lengths(src_tokens)
        max_steps = int(max_lens.max().item()) if S0 else 0
        state = self.runner.start(net_input, k if self.dense else 1, ids)
        tokens = torch.full((S0 * k, max_steps + 2), self.pad, dtype=torch.long, device=device)
        tokens[:, 0] = self.eos if bos_token is None else bos_token
        live = torch.zeros(S0, k, dtype=torch.bool, device=device)
        live[:, 0] = True
        cohort = Cohort(
            k=k, pad=self.pad, step=0, ids=ids.to(device),
            tokens=tokens,
            scores=torch.zeros(S0 * k, max_steps + 1, dtype=self.score_dtype, device=device),
            live=live,
            done_len=torch.zeros(S0, k, dtype=torch.long, device=device),
            max_lens=max_lens,
            empty=src_lengths.eq(0),
            best_finished=torch.full((S0,), -math.inf, dtype=self.score_dtype, device=device),
            run_rows=torch.empty(0, dtype=torch.long, device=device),
            state=state,
        )
        cohort.run_rows = self._run_rows(live)
        return cohort

    def advance(self, c: Cohort) -> Dict[int, List[Dict[str, Tensor]]]:
        """One decoder step for every sentence of ``c``, in place.

        Returns the sentences that finished (id -> hypotheses, best first);
        they leave the cohort.
        """
        t0 = time.perf_counter()
        # The fused layer takes each model's logits (positional: wrappers in tests pass *args).
        # Dense: the run rows are every row, in order; a view, not a gather of every prefix.
        if c.mixed:
            # Each row at its own length: the runner needs only the last tokens.
            last = c.tokens[:, c.step] if self.dense else c.tokens[c.run_rows, c.step]
            out, _ = self.runner.step_own([c.state], last.unsqueeze(1), self.fused)
        else:
            prefixes = c.tokens[:, : c.step + 1] if self.dense else c.tokens[c.run_rows, : c.step + 1]
            out, _ = self.runner.step(c.state, prefixes, self.fused)
        self.stats.add_step(c.longest + 1, c.rows, self._since(t0, out))
        return self.update(c, out)

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
        first = c.select(self.runner, idx[:n])
        return first, c.select(self.runner, idx[n:])

    def join(self, cohorts: List[Cohort], any_length: bool = False) -> Cohort:
        """One cohort of ``cohorts``, sentences in order: all at one step, or (``any_length``) at any step.

        ``any_length`` needs :attr:`joins_lengths` and cohorts that
        :meth:`can_join` (:meth:`Cohort.merge`); the joined cohort's
        sentences keep their own lengths.
        """
        if any_length:
            return Cohort.merge(self.runner, cohorts)
        return Cohort.concat(self.runner, cohorts)

    def advance_together(self, cohorts: List[Cohort]) -> Dict[int, List[Dict[str, Tensor]]]:
        """One decoder call over cohorts of different lengths (VAR-STR-FIFO), then each one's search step."""
        if len(cohorts) == 1:
            return self.advance(cohorts[0])
        t0 = time.perf_counter()
        last = torch.cat([c.tokens[c.run_rows, c.step] for c in cohorts]).unsqueeze(1)
        if any(c.mixed for c in cohorts):
            out, _ = self.runner.step_own([c.state for c in cohorts], last, self.fused)
        else:
            out, _ = self.runner.step_mixed([c.state for c in cohorts], last, [c.step + 1 for c in cohorts],
                                            self.fused)
        rows = sum(c.rows for c in cohorts)
        self.stats.add_step(max(c.longest for c in cohorts) + 1, rows, self._since(t0, out))
        finished, start = {}, 0
        for c in cohorts:
            end = start + c.rows
            part = [x[start:end] for x in out] if self.fused else out[start:end]
            finished.update(self.update(c, part))
            start = end
        return finished

    @property
    def fused(self) -> bool:
        """Whether steps go through the fused output layer (the runner then returns logits)."""
        return self.output_backend != "torch"

    def _since(self, t0: float, out) -> float:
        """Seconds since ``t0`` for the step that produced ``out`` (a tensor or a list of them)."""
        if isinstance(out, list):
            out = out[0]
        # CUDA calls return before the GPU is done; the per-step times kept
        # for plots (Figure 2) would otherwise measure only kernel launches.
        if self.stats.keep_steps and out.is_cuda:
            torch.cuda.synchronize(out.device)
        return time.perf_counter() - t0

    def update(self, c: Cohort, lprobs) -> Dict[int, List[Dict[str, Tensor]]]:
        """The search step of ``c`` given the decoder's output for its run rows (in place).

        ``lprobs`` is the ensemble's log-probabilities (rows, V), or under the
        fused output layer the list of each model's logits.

        Returns the sentences that finished (id -> hypotheses, best first);
        they leave the cohort. The step is tensor operations but for one
        read of a small summary (which sentences end, their ids, how many
        rows stay live and, under ``--finalize fairseq``, how many hypotheses
        each finalized): the only host synchronization of a step in which no
        sentence ends. A step in which some end also reads their hypotheses.
        """
        step_out = self._select(c, *self._candidates(c, lprobs))
        S = c.size
        # The step's one host read (the summary): per sentence, 1 if it ends
        # (+2 for an empty source) and its id, under fairseq's rule the
        # hypotheses each finalized, and the live rows left; for a runner
        # that moves rows without reading the device, each sentence's live
        # rows after them.
        per_sentence = not self.dense and getattr(self.runner, "sync_free", False)
        summary = step_out.summary
        if per_sentence:
            summary = torch.cat([summary, step_out.sel.live.sum(dim=1)])
        summary = read_host(summary)
        ids = summary[S: 2 * S]
        ending = [s for s in range(S) if summary[s] & 1] if any(summary[:S]) else []
        if self.finalize == "fairseq":
            self.finalizer.after_step(step_out.sel, c, ids, summary[2 * S: 3 * S])
        results = self._finished(c, step_out, ending, ids, summary) if ending else {}
        rows = summary[-S:] if per_sentence else None
        self._next_beam(c, step_out, ending, summary[-S - 1] if per_sentence else summary[-1], rows)
        return results

    def _candidates(self, c: Cohort, lprobs):
        """(cand, local, word_of, per_slot): each sentence's candidate scores (sentences, slots x per_slot),
        their single-word log-probabilities, the word of each candidate (None: its index mod V)."""
        k, V, S, step = self.beam_size, self.vocab_size, c.size, c.step
        if self.fused:
            return self._fused_candidates(c, lprobs)
        lprobs = self._constrain(c, lprobs)
        if step == 0 and self.dense:
            # All slots hold the same start: extend slot 0 only (as fairseq).
            cand = self._nan_to_neg_inf_(lprobs.view(S, k, V)[:, 0, :])
            return cand, cand, None, V
        if self.dense:
            # In place: nothing reads the log-probabilities of single words
            # here (dense means no pruning heuristic, the only reader).
            cand = self._nan_to_neg_inf_(lprobs.add_(c.scores[:, step - 1: step]).view(S, k * V))
            return cand, cand, None, V
        # Each row's best candidates first: a sentence's best k (2k for
        # fairseq's rule) are among its rows' best k (2k), so selection
        # then works on (sentences, k x n) instead of x V. Each row goes
        # to its own slot (empty slots hold -inf), so that a candidate's
        # slot is its index // n and no count of live rows is read back.
        n = self.candidates_per_row
        row_scores = lprobs + c.scores[c.run_rows, step - 1: step] if step > 0 else lprobs
        top_scores, top_words = torch.topk(self._nan_to_neg_inf_(row_scores), k=n, dim=1)
        top_local = self._nan_to_neg_inf_(lprobs.gather(1, top_words))
        cand, local, word_of = self._by_slot(S, c.run_rows, top_scores, top_local, top_words)
        return cand, local, word_of, n

    def _select(self, c: Cohort, cand, local, word_of, per_slot):
        """The finalization rule's selection over the candidates (``stay_step`` or ``fairseq_step``)."""
        k = self.beam_size
        if self.finalize == "stay":
            return stay_step(cand, local, k, per_slot, self.eos, self.pad, self.pruning, c.step, c.done_len,
                             c.scores, c.empty, c.ids, word_of)
        # No finished hypothesis stays on the beam here, so done_len
        # counts the finalized ones instead (see fairseq_step): the count
        # travels with the sentence when cohorts split or join.
        step_out = fairseq_step(cand, local, k, per_slot, self.eos, self.pruning, c.step, c.done_len,
                                c.best_finished, c.max_lens, c.empty, c.ids, word_of, ignore=self._ignore(c))
        c.best_finished = step_out.best_finished
        return step_out

    def _ignore(self, c: Cohort) -> Optional[Tensor]:
        """fairseq's ranks to ignore this step (:func:`~fairseq_stream.search.selection.forced_eos_ranks`), or
        None: only a dense beam of V - 1 slots can have been forced to take an EOS."""
        if not (self.dense and self.beam_size >= self.vocab_size - 1 and c.step > 0):
            return None
        S, k = c.size, self.beam_size
        return forced_eos_ranks(c.tokens[:, c.step].view(S, k), c.scores[:, c.step - 1].view(S, k), self.eos)

    def _finished(self, c: Cohort, step_out, ending: List[int], ids: List[int], summary: List[int]):
        """{id: hypotheses, best first} of the sentences ``ending`` this step."""
        ending_rows = self._compact(step_out.finished_now, len(ending))
        collected = self.finalizer.collect(c, step_out, ending_rows, ending, ids, self.scores)
        results: Dict[int, List[Dict[str, Tensor]]] = {}
        for s, (hyps, values) in zip(ending, collected):
            if summary[s] & 2:
                # Empty sources get an empty hypothesis (fairseq would
                # translate the lone EOS into something).
                hyps, values = [self.empty_hypothesis(c.tokens.device)], [0.0]
            results[ids[s]] = hyp.best_first(hyps, values)
        return results

    def _next_beam(self, c: Cohort, step_out, ending: List[int], n_live: int, live_rows: Optional[List[int]] = None):
        """Move ``c`` to the next step: slot j of sentence s continues slot ``flat_parent``; ended sentences
        leave; the runner's rows follow (``live_rows``: each sentence's live rows, where the runner takes
        them)."""
        device, k, S, step = c.tokens.device, self.beam_size, c.size, c.step
        sel, flat_parent, extended = step_out.sel, step_out.flat_parent, step_out.extended
        if self.dense:
            # As fairseq: every slot takes the candidate picked for it, also one that cannot go on (-inf where
            # the beam is wider than the words at step 0, or an EOS forced in); left as it was, the slot would
            # extend its old prefix (padding, score 0) and outrank every real hypothesis.
            extended = torch.ones_like(extended)
        new_token, new_score = sel.token.view(-1), sel.score.view(-1)
        tokens, scores, live, done_len, run_rows = c.tokens, c.scores, sel.live, step_out.done_len, c.run_rows
        if ending:
            keep = self._compact(~step_out.finished_now, S - len(ending))
            rows_keep = (keep.unsqueeze(1) * k + torch.arange(k, device=device)).view(-1)
            flat_parent = flat_parent.index_select(0, rows_keep)
            # Whole rows in one copy: the columns not written yet are padding in every row.
            tokens, scores = tokens.index_select(0, flat_parent), scores.index_select(0, flat_parent)
            extended, new_token, new_score = (t.index_select(0, rows_keep) for t in (extended, new_token, new_score))
            live, done_len = live.index_select(0, keep), done_len.index_select(0, keep)
            c.ids, c.max_lens = c.ids.index_select(0, keep), c.max_lens.index_select(0, keep)
            c.empty, c.best_finished = c.empty.index_select(0, keep), c.best_finished.index_select(0, keep)
            if c.mixed:
                gone = set(ending)
                c.start = c.start.index_select(0, keep)
                c.start_host = [a for s, a in enumerate(c.start_host) if s not in gone]
            tokens[:, step + 1] = torch.where(extended, new_token, tokens[:, step + 1])
            scores[:, step] = torch.where(extended, new_score, scores[:, step])
        else:
            # In place; only the columns written so far need moving.
            reorder_beam_(tokens, scores, flat_parent, extended, new_token, new_score, step)
        c.tokens, c.scores, c.live, c.done_len = tokens, scores, live, done_len
        c.step = step + 1
        if ending or not self.dense:  # dense, no sentence gone: every row still runs, in order
            c.run_rows = self._run_rows(live, None if self.dense else n_live)
        if self.dense:
            order = flat_parent  # every slot is a runner row
        else:
            # The runner holds one row per previous run row.
            prev_row = torch.full((S * k,), -1, dtype=torch.long, device=device)
            prev_row.index_copy_(0, run_rows, torch.arange(run_rows.numel(), device=device))
            order = prev_row.index_select(0, flat_parent.index_select(0, c.run_rows))
        # One row per sentence (greedy) and none gone: every row continues itself, nothing to move.
        if c.size and not (self.dense and k == 1 and not ending):
            if getattr(self.runner, "sync_free", False):
                # The runner moves its rows by each sentence's count instead of reading them back.
                gone = set(ending)
                rows = [0 if s in gone else (k if self.dense else live_rows[s]) for s in range(S)]
                self.runner.reorder(c.state, order, sentence_rows=rows)
            else:
                self.runner.reorder(c.state, order)

    def _fused_candidates(self, c: Cohort, logits: List[Tensor]):
        """``update``'s candidates from the models' logits by the fused output layer.

        The same candidates as the reference path (each row's best n by
        cumulative score, in one (S, k x n) layout with -inf for rows not
        run), but the log-softmax, the rules and the top-n are one kernel
        call over the logits, and only (rows, n) values come back.

        Returns:
            (cand, local, word_of, per_slot) as ``update`` uses them.
        """
        k, S, step, n = self.beam_size, c.size, c.step, self.candidates_per_row
        rows = c.run_rows
        if step == 0 and self.dense:
            # All slots hold the same start: extend slot 0 only (as fairseq).
            logits = [x[::k] for x in logits]
            rows = rows[::k]
        force_eos = None
        if step >= self.shortest_max_len:
            force_eos = c.max_lens.le(step).index_select(0, rows // k)
        # The arguments are the decoder's own and keep their kinds from step to step.
        out = self.top_candidates(logits, n, ban_eos=step < self.min_len, force_eos=force_eos, check=step == 0)
        top_local = out.values
        if step == 0 and self.dense and n >= self.vocab_size:
            # Every word of slot 0: fairseq's first step takes the best V - 1 (a beam of V - 1 then takes the
            # last one even if it is an EOS), so none of the other slots' -inf may stand in for them.
            m = self.vocab_size - 1
            return top_local[:, :m], top_local[:, :m], out.indices[:, :m], m
        if self.dense and step > 0:  # every slot is a run row, in order: a slice, not a gather
            top_scores = top_local + c.scores[:, step - 1 : step]
            return top_scores.view(S, k * n), top_local.view(S, k * n), out.indices.view(S, k * n), n
        top_scores = top_local + c.scores[rows, step - 1 : step] if step > 0 else top_local
        return (*self._by_slot(S, rows, top_scores, top_local, out.indices), n)

    def top_candidates(self, logits, n: int, ban_eos=None, force_eos: Optional[Tensor] = None,
                       check: bool = True) -> OutputLayerResult:
        """Each row's ``n`` best words and their log-probabilities from the models' ``logits``: the fused layer.

        fairseq's step rules with this decoder's settings (PAD never chosen,
        ``--unkpen``, ``--temperature``), EOS banned where ``ban_eos`` (True
        or a row mask: below ``--min-len``) and forced where ``force_eos`` (a
        row mask: at the maximum length), on this decoder's output backend;
        ``check``: validate the arguments (see
        :func:`~fairseq_stream.ops.topk_log_softmax`). Jacobi's windows use it
        to keep greedy's rules.
        """
        return topk_log_softmax(logits, n, pad=self.pad, eos=self.eos, unk=self.unk, unk_penalty=self.unk_penalty,
                                temperature=self.temperature, ban_eos=ban_eos, force_eos=force_eos,
                                backend=self.output_backend, check=check)

    def _by_slot(self, S: int, rows: Tensor, top_scores: Tensor, top_local: Tensor, top_words: Tensor):
        """Each run row's n candidates moved to its beam slot: (cand, local, word_of), each (S, k x n).

        Slots not run hold -inf candidates, so that a candidate's slot is its
        index // n and no count of live rows is read back.
        """
        k, n = self.beam_size, top_scores.size(1)
        cand = top_scores.new_full((S * k, n), -math.inf).index_copy_(0, rows, top_scores)
        local = top_local.new_zeros((S * k, n)).index_copy_(0, rows, top_local)
        word_of = top_words.new_zeros((S * k, n)).index_copy_(0, rows, top_words)
        return cand.view(S, k * n), local.view(S, k * n), word_of.view(S, k * n)

    def _constrain(self, c: Cohort, lprobs: Tensor) -> Tensor:
        """``lprobs`` in the score type with fairseq's rules applied (pad, --unkpen, lengths, n-grams).

        NaNs are left for the caller, which turns them into -inf on the
        candidates it builds anyway (one pass over the vocabulary fewer).
        """
        step = c.step
        at_max = None
        if step >= self.shortest_max_len:
            # Sentences at their maximum length may only end.
            at_max = c.max_lens.le(step).index_select(0, c.run_rows // self.beam_size)
        lprobs = apply_step_rules(lprobs.to(self.score_dtype), self.pad, self.eos, self.unk, self.unk_penalty, at_max,
                                  step < self.min_len)
        if self.repeat_ngram_blocker is not None:
            rows = c.run_rows.numel()
            lprobs = self.repeat_ngram_blocker(c.tokens[c.run_rows], lprobs, rows, 1, step)
        return lprobs

    def _shortest_max_len(self) -> int:
        """A lower bound on every sentence's maximum length (:meth:`max_lengths`), known on the host.

        Below it no sentence can be at its maximum length, and the step skips
        the masking of rows, a pass over the vocabulary. Computed once, in
        the constructor: it depends only on the length options.
        """
        a, b = self.max_len_a, self.max_len_b
        if not a >= 0:
            return 0
        try:
            # max_lengths: (width * a + b) in float32, truncated, and width * a >= 0.
            floor = int(struct.unpack("f", struct.pack("f", b))[0])
        except (OverflowError, ValueError, struct.error):
            return 0
        return min(floor, self.max_len - 1)

    @staticmethod
    def _nan_to_neg_inf_(t: Tensor) -> Tensor:
        """``t`` with NaN replaced by -inf, in place (as fairseq's ``lprobs[lprobs != lprobs]``, without its sync)."""
        return t.nan_to_num_(nan=-math.inf, posinf=math.inf, neginf=-math.inf)

    # ``mask.nonzero()`` without its host sync where the caller knows the count.
    _compact = staticmethod(compact)

    def _run_rows(self, live, n_live: Optional[int] = None):
        """Rows to run through the decoder: all slots when dense, else the ``n_live`` live ones.

        Without ``n_live`` (a new cohort) the live rows are counted, a host sync.
        """
        if self.dense:
            return torch.arange(live.numel(), device=live.device)
        if n_live is None:
            return live.view(-1).nonzero().flatten()
        return self._compact(live, n_live)

    # -- scoring (the finalizer's scorer; Jacobi's too) ---------------------

    def scores(self, finals: List[float], lens: List[int]) -> Tuple[List[float], List[Tensor]]:
        """This search's hypothesis scores from cumulative ones: the values on the host (to rank by) and
        fairseq's 0-d score tensors, both as fairseq makes them on the models' device
        (:func:`fairseq_stream.hypotheses.normalized`, :func:`fairseq_stream.hypotheses.score_tensors`)."""
        from fairseq_stream.runners.base import module_device

        device = module_device(self.runner.model)
        values = hyp.normalized(finals, lens, self.score_dtype, self.normalize_scores, self.len_penalty,
                                reciprocal=device.type == "cuda")
        return values, hyp.score_tensors(values, self.score_dtype, device)

    def empty_hypothesis(self, device) -> Dict[str, Tensor]:
        """The hypothesis of an empty source."""
        return hyp.empty_hypothesis(self.eos, device)
