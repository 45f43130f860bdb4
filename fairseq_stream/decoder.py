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

import logging
import math
import time
from typing import Dict, List, Optional

import torch
from torch import Tensor

from fairseq_stream.cohort import Cohort
from fairseq_stream.errors import FairseqStreamError
from fairseq_stream.runners import build_runner
from fairseq_stream.search.pruning import Pruning
from fairseq_stream.search.selection import select_fairseq, select_stay
from fairseq_stream.stats import DecodeStats

logger = logging.getLogger(__name__)

FINALIZE_MODES = ("fairseq", "stay")


class BeamDecoder:
    """A fairseq generator (``generate(models, sample, ...)``) running our beam loop.

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
        runner: ``fairseq`` (the reference), ``lean`` or ``auto``; see
            :func:`fairseq_stream.runners.build_runner`.
    """

    def __init__(
        self,
        models,
        tgt_dict,
        beam_size: int = 5,
        finalize: str = "fairseq",
        pruning: Optional[Pruning] = None,
        stats: Optional[DecodeStats] = None,
        max_len_a: float = 0,
        max_len_b: int = 200,
        min_len: int = 1,
        normalize_scores: bool = True,
        len_penalty: float = 1.0,
        unk_penalty: float = 0.0,
        temperature: float = 1.0,
        no_repeat_ngram_size: int = 0,
        runner: str = "fairseq",
    ):
        if finalize not in FINALIZE_MODES:
            raise FairseqStreamError(
                "--finalize must be one of {}, got {}".format(", ".join(FINALIZE_MODES), finalize)
            )
        if temperature <= 0:
            raise FairseqStreamError("--temperature must be greater than 0")
        # fairseq's exact arithmetic: every slot is a decoder row, as in SequenceGenerator.
        self.dense = finalize == "fairseq" and not (pruning is not None and pruning.active)
        self.runner = build_runner(runner, models, temperature=temperature, keep_fairseq=self.dense)
        # Scores accumulate in the models' precision where it is float64
        # (exactness tests), in float32 otherwise (fairseq's log-softmax dtype).
        self.score_dtype = torch.float64 if self.runner.dtype == torch.float64 else torch.float32
        self.tgt_dict = tgt_dict
        self.pad, self.unk, self.eos = tgt_dict.pad(), tgt_dict.unk(), tgt_dict.eos()
        self.vocab_size = len(tgt_dict)
        self.beam_size = min(beam_size, self.vocab_size - 1)
        self.finalize = finalize
        self.pruning = pruning or Pruning()
        self.stats = stats if stats is not None else DecodeStats()
        self.max_len_a, self.max_len_b = max_len_a, max_len_b
        self.min_len = min_len
        self.max_len = self.runner.max_decoder_positions()
        self.normalize_scores = normalize_scores
        self.len_penalty = len_penalty
        self.unk_penalty = unk_penalty
        self.symbols_to_strip_from_output = {self.eos}
        self._warned_cap = False
        self.repeat_ngram_blocker = None
        if no_repeat_ngram_size > 0:
            from fairseq.ngram_repeat_block import NGramRepeatBlock

            self.repeat_ngram_blocker = NGramRepeatBlock(no_repeat_ngram_size)

    def cuda(self):
        self.runner.cuda()
        return self

    @torch.no_grad()
    def generate(self, models, sample, prefix_tokens=None, constraints=None, bos_token=None, **kwargs):
        """Translate a fairseq sample; one list of hypotheses per sentence, in sample order."""
        self.check_call(prefix_tokens, constraints)
        start = time.perf_counter()
        cohort = self.open(sample["net_input"], bos_token=bos_token)
        results = {}
        while cohort.size:
            results.update(self.advance(cohort))
        self.stats.add_sentences(len(results), time.perf_counter() - start)
        return [results[i] for i in range(len(results))]

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
        lprobs, _ = self.runner.step(c.state, c.tokens[c.run_rows, : c.step + 1])
        self.stats.add_step(c.step + 1, c.rows, self._since(t0, lprobs))
        return self.update(c, lprobs)

    def advance_together(self, cohorts: List[Cohort]) -> Dict[int, List[Dict[str, Tensor]]]:
        """One decoder call over cohorts of different lengths (VAR-STR-FIFO), then each one's search step."""
        if len(cohorts) == 1:
            return self.advance(cohorts[0])
        t0 = time.perf_counter()
        last = torch.cat([c.tokens[c.run_rows, c.step] for c in cohorts]).unsqueeze(1)
        lprobs, _ = self.runner.step_mixed([c.state for c in cohorts], last,
                                                  [c.step + 1 for c in cohorts])
        rows = sum(c.rows for c in cohorts)
        self.stats.add_step(max(c.step for c in cohorts) + 1, rows, self._since(t0, lprobs))
        finished, start = {}, 0
        for c in cohorts:
            end = start + c.rows
            finished.update(self.update(c, lprobs[start:end]))
            start = end
        return finished

    def _since(self, t0: float, out: Tensor) -> float:
        """Seconds since ``t0`` for the step that produced ``out``."""
        # CUDA calls return before the GPU is done; the per-step times kept
        # for plots (Figure 2) would otherwise measure only kernel launches.
        if self.stats.keep_steps and out.is_cuda:
            torch.cuda.synchronize(out.device)
        return time.perf_counter() - t0

    def update(self, c: Cohort, lprobs: Tensor) -> Dict[int, List[Dict[str, Tensor]]]:
        """The search step of ``c`` given the decoder's output for its run rows (in place)."""
        device = c.tokens.device
        k, V = self.beam_size, self.vocab_size
        stay = self.finalize == "stay"
        step, run_rows, max_lens = c.step, c.run_rows, c.max_lens
        tokens, scores = c.tokens, c.scores
        S = c.size

        # Row r of lprobs is slot run_rows[r]; all slots when dense.
        row_sentence = run_rows // k

        lprobs = lprobs.to(self.score_dtype)
        lprobs[lprobs != lprobs] = -math.inf
        lprobs[:, self.pad] = -math.inf
        lprobs[:, self.unk] -= self.unk_penalty
        at_max = (step >= max_lens)[row_sentence]
        if at_max.any():
            eos_col = lprobs[at_max, self.eos].clone()
            lprobs[at_max] = -math.inf
            lprobs[at_max, self.eos] = eos_col
        if step < self.min_len:
            lprobs[:, self.eos] = -math.inf
        if self.repeat_ngram_blocker is not None:
            rows = run_rows.numel()
            lprobs = self.repeat_ngram_blocker(tokens[run_rows], lprobs, rows, 1, step)

        word_of = None  # candidate index -> word, where candidates are not the whole vocabulary
        per_slot = V  # candidates per beam slot in cand
        if step == 0 and self.dense:
            # All slots hold the same start: extend slot 0 only (as fairseq).
            cand = local = lprobs.view(S, k, V)[:, 0, :]
            slot_of = None
        elif self.dense:
            local = lprobs.view(S, k * V)
            cand = (lprobs + scores[:, step - 1 : step]).view(S, k * V)
            slot_of = None
        else:
            # Each row's best candidates first: a sentence's best k (2k for
            # fairseq's rule) are among its rows' best k (2k), so selection
            # then works on (sentences, widest beam x n) instead of x V.
            n = min(k if stay else 2 * k, V)
            row_scores = lprobs + scores[run_rows, step - 1 : step] if step > 0 else lprobs
            top_scores, top_words = torch.topk(row_scores, k=n, dim=1)
            position, width = self._pack_positions(row_sentence, S)
            packed = top_scores.new_full((S, width, n), -math.inf)
            packed[row_sentence, position] = top_scores
            cand = packed.view(S, width * n)
            words = top_words.new_zeros((S, width, n))
            words[row_sentence, position] = top_words
            word_of = words.view(S, width * n)
            local = lprobs.new_zeros((S, width, n))
            local[row_sentence, position] = lprobs.gather(1, top_words)
            local = local.view(S, width * n)
            slot_of = torch.zeros(S, width, dtype=torch.long, device=device)
            slot_of[row_sentence, position] = run_rows % k
            per_slot = n

        finished: Dict[int, List[Dict[str, Tensor]]] = {}
        if stay:
            sel = select_stay(cand, local, self._done_scores(c.done_len, scores, S, k),
                              k, per_slot, self.eos, self.pad, self.pruning, word_of)
        else:
            sel = select_fairseq(cand, local, k, per_slot, self.eos, self.pruning, c.best_finished, word_of)
            if slot_of is not None:
                sel.eos_slot = slot_of[sel.eos_sentence, sel.eos_slot]
            self._finalize_fairseq(sel, step, c.finalized, c.ids, c.best_finished, tokens, scores, k)
            counts = torch.tensor([len(c.finalized.get(i, ())) for i in c.ids.tolist()], device=device)
            sel.finished |= counts.ge(k) | max_lens.le(step)
        if slot_of is not None:
            carried = sel.done & ~sel.fresh
            sel.parent = torch.where(carried, sel.parent, slot_of.gather(1, sel.parent.clamp(max=slot_of.size(1) - 1)))
        finished_now = sel.finished | c.empty
        new_done_len = torch.where(
            sel.fresh, torch.full_like(sel.parent, step + 1), c.done_len.gather(1, sel.parent)
        ).masked_fill(~sel.done, 0)

        ending = finished_now.nonzero().flatten()
        if ending.numel():
            collected = self._collect_stay(ending, sel, new_done_len, tokens, scores, k) if stay else None
            for e, (sid, empty) in enumerate(zip(c.ids[ending].tolist(), c.empty[ending].tolist())):
                if empty:
                    # Empty sources get an empty hypothesis (fairseq would
                    # translate the lone EOS into something).
                    hyps = [self._empty_hypo(device)]
                elif stay:
                    hyps = collected[e]
                else:
                    hyps = c.finalized.pop(sid, [])
                order = torch.sort(torch.tensor([float(h["score"]) for h in hyps]), descending=True)[1]
                finished[sid] = [hyps[i] for i in order]

        # Build the next beam: slot j of sentence s continues slot parent[s, j].
        flat_parent = (sel.parent + torch.arange(S, device=device).unsqueeze(1) * k).view(-1)
        # Only the columns written so far need moving (S * k rows either way).
        tokens[:, : step + 1] = tokens[:, : step + 1].index_select(0, flat_parent)
        scores[:, :step] = scores[:, :step].index_select(0, flat_parent)
        extended = (sel.live | sel.fresh).view(-1)
        tokens[extended, step + 1] = sel.token.view(-1)[extended]
        scores[extended, step] = sel.score.view(-1)[extended]
        prev_live_row = torch.full((S * k,), -1, dtype=torch.long, device=device)
        prev_live_row[run_rows] = torch.arange(run_rows.numel(), device=device)
        live, done_len = sel.live, new_done_len

        keep = ~finished_now
        if not keep.all():
            rows_keep = keep.repeat_interleave(k)
            tokens, scores = tokens[rows_keep], scores[rows_keep]
            flat_parent = flat_parent[rows_keep]
            live, done_len = live[keep], done_len[keep]
            c.ids, c.max_lens, c.empty = c.ids[keep], max_lens[keep], c.empty[keep]
            c.best_finished = c.best_finished[keep]
        c.tokens, c.scores, c.live, c.done_len = tokens, scores, live, done_len
        c.step = step + 1
        c.run_rows = self._run_rows(live)
        if c.size:
            # The runner holds one row per previous run row (all slots when dense).
            self.runner.reorder(c.state, prev_live_row[flat_parent[c.run_rows]])
        return finished

    @staticmethod
    def _pack_positions(row_sentence, S):
        """Position of each run row among its sentence's run rows, and the widest beam."""
        counts = torch.bincount(row_sentence, minlength=S)
        starts = torch.cumsum(counts, 0) - counts
        position = torch.arange(row_sentence.numel(), device=row_sentence.device) - starts[row_sentence]
        return position, max(int(counts.max()), 1)

    def _run_rows(self, live):
        """Rows to run through the decoder: all slots when dense, else the live ones."""
        if self.dense:
            return torch.arange(live.numel(), device=live.device)
        return live.view(-1).nonzero().flatten()

    # -- finalization bookkeeping ------------------------------------------

    def _finalize_fairseq(self, sel, step, finalized, sent_ids, best_finished, tokens, scores, k):
        """Store the EOS hypotheses ``select_fairseq`` finalized, at most k per sentence."""
        if sel.eos_sentence.numel() == 0:
            return
        rows = sel.eos_sentence * k + sel.eos_slot
        lengths = torch.full_like(rows, step + 1)
        hyps = self._hypotheses(rows, lengths, sel.eos_score, tokens, scores)
        ids = sent_ids.tolist()
        for s, hyp in zip(sel.eos_sentence.tolist(), hyps):
            kept = finalized.setdefault(ids[s], [])
            if len(kept) < k:
                kept.append(hyp)
        best_finished.scatter_reduce_(0, sel.eos_sentence, sel.eos_score.to(best_finished.dtype), reduce="amax")

    @staticmethod
    def _done_scores(done_len, scores, S, k):
        """Cumulative score of each finished slot on the beam (-inf elsewhere)."""
        last = scores.view(S, k, -1).gather(2, (done_len - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return last.masked_fill(done_len.eq(0), -math.inf)

    def _hypotheses(self, rows: Tensor, lengths: Tensor, final: Tensor, tokens: Tensor, scores: Tensor):
        """fairseq hypotheses for the prefixes in ``rows`` ending with EOS, all in one go.

        Args:
            rows: (P,) rows of ``tokens``/``scores`` holding the prefixes.
            lengths: (P,) each hypothesis' length, its EOS included.
            final: (P,) each one's cumulative score, its EOS included.

        A handful of tensor operations for all P hypotheses: built one by one
        they cost several kernel launches and host syncs each, which on a GPU
        was a fifth of a var-batch pass (docs/BENCHMARKS.md).
        """
        if rows.numel() == 0:
            return []
        lens = lengths.tolist()
        width = max(lens)
        last = (lengths - 1).unsqueeze(1)
        hyp_tokens = tokens.index_select(0, rows)[:, 1 : width + 1].clone()
        hyp_tokens.scatter_(1, last, self.eos)
        pos = scores.index_select(0, rows)[:, :width].clone()
        pos.scatter_(1, last, final.to(pos.dtype).unsqueeze(1))
        pos[:, 1:] = pos[:, 1:] - pos[:, :-1]
        # float32 (float64 for float64 models) on the CPU, divided per length as fairseq's ``eos_scores /=
        # (step + 1) ** len_penalty``, so scores and their ranking match bitwise.
        normalized = final.to(self.score_dtype).cpu()
        if self.normalize_scores:
            by_length = torch.tensor(lens)
            for length in set(lens):
                same = by_length == length
                normalized[same] = normalized[same] / (length ** self.len_penalty)
        # No attention history is kept: nothing reads it without
        # --print-alignment, which these searches refuse.
        return [
            {
                "tokens": hyp_tokens[p, :length],
                "score": torch.tensor(score, dtype=self.score_dtype),
                "attention": torch.empty(0),
                "alignment": torch.empty(0),
                "positional_scores": pos[p, :length],
            }
            for p, (length, score) in enumerate(zip(lens, normalized.tolist()))
        ]

    def _empty_hypo(self, device):
        return {
            "tokens": torch.tensor([self.eos], device=device),
            "score": torch.tensor(0.0),
            "attention": torch.empty(0),
            "alignment": torch.empty(0),
            "positional_scores": torch.zeros(1, device=device),
        }

    def _collect_stay(self, ending: Tensor, sel, done_len: Tensor, tokens: Tensor, scores: Tensor, k: int):
        """For each sentence in ``ending``, the finished entries of its final beam as fairseq hypotheses."""
        owner, slot = sel.done[ending].nonzero(as_tuple=True)
        sentence = ending[owner]
        hyps = self._hypotheses(sentence * k + sel.parent[sentence, slot], done_len[sentence, slot],
                                sel.score[sentence, slot], tokens, scores)
        collected = [[] for _ in range(ending.numel())]
        for e, hyp in zip(owner.tolist(), hyps):
            collected[e].append(hyp)
        return collected
