"""Finalization: how a beam's finished hypotheses are kept, and collected when their sentence ends.

The decoder's bookkeeping (:class:`~fairseq_stream.cohort_steps.BeamBookkeeping`) asks its
finalizer two things, after each step's one host read (as fairseq's
``search.py`` keeps each search's rule behind ``Search.step``):

* :meth:`Finalizer.after_step` (sel, cohort, ids, n_final): keep what the
  step finalized (fairseq's rule stores its EOS hypotheses; ours keeps them
  on the beam, nothing to store);
* :meth:`Finalizer.finished` (cohort, step_out, ending, ids, summary,
  scores): the hypotheses of the sentences that end, best first (each
  rule's :meth:`Finalizer.collect` gathers them).

``scores`` is the decoder's (cumulative scores, lengths) -> (values, score
tensors): the normalization by ``--lenpen`` on the models' device.
:func:`finalizer` picks the rule's finalizer. Both share the building of
fairseq hypotheses from the cohort's prefixes (:meth:`Finalizer.hypotheses`).
"""

from typing import Callable, Dict, List, Optional

import torch
from torch import Tensor

from fairseq_stream import hypotheses as hyp
from fairseq_stream.cohort import Cohort
from fairseq_stream.ops.packing import compact


def to_device(t: Tensor, device) -> Tensor:
    """A host tensor ``t`` on ``device``: on CUDA copied from pinned memory without waiting for the steps queued
    before it (:func:`read_host` the other way)."""
    if torch.device(device).type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def read_host(t: Tensor) -> list:
    """``t.tolist()``: a step's read of the device (its summary; the hypotheses of sentences that end). On CUDA
    through a pinned buffer (one DMA, no staging copy), waiting for this stream only."""
    if not t.is_cuda:
        return t.tolist()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    torch.cuda.current_stream(t.device).synchronize()
    return host.tolist()


Scorer = Callable[[List[float], List[int]], tuple]


class Finalizer:
    """The finalization rule of a beam of ``k`` slots (EOS ``eos``): see the module docstring."""

    def __init__(self, k: int, eos: int):
        self.k, self.eos = k, eos

    def after_step(self, sel, c: Cohort, ids: List[int], n_final: List[int], finals: Optional[List[float]] = None):
        """Keep what ``c``'s step finalized (``ids``, ``n_final``: the host's copy from the step's read;
        ``finals``: their cumulative scores where the host already has them, else read when they are scored)."""

    def collect(self, c: Cohort, step_out, ending_rows: Tensor, ending: List[int], ids: List[int],
                scores: Scorer):
        """[(hypotheses, their scores on the host)] of the sentences ``ending`` (rows ``ending_rows``) of ``c``."""
        raise NotImplementedError

    def finished(self, c: Cohort, step_out, ending: List[int], ids: List[int], summary: List[int],
                 scores: Scorer) -> Dict[int, List[Dict[str, Tensor]]]:
        """{id: hypotheses, best first} of the sentences ``ending`` this step (``summary``: the step's read)."""
        collected = self.collect(c, step_out, compact(step_out.finished_now, len(ending)), ending, ids, scores)
        results: Dict[int, List[Dict[str, Tensor]]] = {}
        for s, (hyps, values) in zip(ending, collected):
            if summary[s] & 2:
                # Empty sources get an empty hypothesis (fairseq would
                # translate the lone EOS into something).
                hyps, values = [hyp.empty_hypothesis(self.eos, c.tokens.device)], [0.0]
            results[ids[s]] = hyp.best_first(hyps, values)
        return results

    def score_finalized(self, per_sentence, scores: Scorer):
        """Score the stored hypotheses of sentences that end (one read for those whose cumulative score is still
        on the device; none where the host copied them with their step: late reads); [(hyps, scores)]."""
        pending = [h for hyps in per_sentence for h in hyps]
        if not pending:
            return [(hyps, []) for hyps in per_sentence]
        finals = [h.pop("_final") for h in pending]
        on_device = [i for i, f in enumerate(finals) if isinstance(f, Tensor)]
        if on_device:
            for i, value in zip(on_device, read_host(torch.stack([finals[i] for i in on_device]))):
                finals[i] = value
        values, score_tensors = scores(finals, [h["tokens"].numel() for h in pending])
        for h, score in zip(pending, score_tensors):
            h["score"] = score
        out, start = [], 0
        for hyps in per_sentence:
            out.append((hyps, values[start : start + len(hyps)]))
            start += len(hyps)
        return out

    def hypotheses(self, rows: Tensor, lengths: Tensor, lens: List[int], final: Tensor, tokens: Tensor,
                   scores: Tensor, starts: Optional[Tensor] = None):
        """fairseq hypotheses for the prefixes in ``rows`` ending with EOS, all in one go, unscored.

        Args:
            rows: (P,) rows of ``tokens``/``scores`` holding the prefixes.
            lengths: (P,) each hypothesis' length, its EOS included.
            lens: the same lengths on the host.
            final: (P,) each one's cumulative score, its EOS included.
            starts: (P,) the column where each prefix begins (a cohort of
                mixed lengths, :meth:`Cohort.merge`); None: column 0.

        A handful of tensor operations for all P hypotheses and no host sync:
        built one by one they cost several kernel launches and host syncs
        each, which on a GPU was a fifth of a var-batch pass
        (docs/BENCHMARKS.md). The caller sets ``score``.
        """
        if not lens:
            return []
        width = max(lens)
        last = (lengths - 1).unsqueeze(1)
        if starts is None:
            hyp_tokens = tokens[:, 1 : width + 1].index_select(0, rows)
            pos = scores[:, :width].index_select(0, rows)
        else:
            # Each prefix's own columns; past a shorter prefix's end, columns are clamped (and cut off below).
            cols = starts.unsqueeze(1) + torch.arange(width, device=rows.device)
            hyp_tokens = tokens.index_select(0, rows).gather(1, (cols + 1).clamp(max=tokens.size(1) - 1))
            pos = scores.index_select(0, rows).gather(1, cols.clamp(max=scores.size(1) - 1))
        hyp_tokens.scatter_(1, last, self.eos)
        pos.scatter_(1, last, final.to(pos.dtype).unsqueeze(1))
        pos[:, 1:] = pos[:, 1:] - pos[:, :-1]
        # No attention history is kept: nothing reads it without
        # --print-alignment, which these searches refuse.
        return [hyp.hypothesis(hyp_tokens[p, :length], pos[p, :length]) for p, length in enumerate(lens)]


class FairseqFinalizer(Finalizer):
    """fairseq's rule: a candidate ending in EOS among the best k of 2k is finalized at once and stored in the
    cohort (``c.finalized``), at most k per sentence, scored when its sentence ends."""

    def after_step(self, sel, c: Cohort, ids: List[int], n_final: List[int], finals: Optional[List[float]] = None):
        """Store the EOS hypotheses ``fairseq_step`` finalized in ``c``'s step, at most k per sentence.

        ``ids`` and ``n_final`` (how many each sentence finalized) are the
        host's copy from the step's read. Nothing is read back here: each
        hypothesis keeps its cumulative score (``_final``) on the device, or
        on the host where ``finals`` gives them (the late reader copied them
        with the step), and is scored when its sentence ends
        (:meth:`score_finalized`).
        """
        total = sum(n_final)
        if not total:
            return
        k, step, finalized = self.k, c.step, c.finalized
        flat = compact(sel.eos_mask, total)  # by sentence, then rank
        rows = (flat // k) * k + sel.top_slot.reshape(-1).index_select(0, flat)
        final = sel.top_score.reshape(-1).index_select(0, flat)
        if c.mixed:
            # Each hypothesis' length from its own sentence's start.
            lens = [step + 1 - c.start_host[s] for s, count in enumerate(n_final) for _ in range(count)]
            starts = c.start.index_select(0, flat // k)
            # The lengths on the device from the starts there (not a copy of the host's list).
            hyps = self.hypotheses(rows, step + 1 - starts, lens, final, c.tokens, c.scores, starts)
        else:
            hyps = self.hypotheses(rows, torch.full_like(rows, step + 1), [step + 1] * total, final, c.tokens,
                                   c.scores)
        p = 0
        for s, n in enumerate(n_final):
            if n:
                kept = finalized.setdefault(ids[s], [])
                for q in range(p, p + n):
                    if len(kept) < k:
                        hyps[q]["_final"] = final[q] if finals is None else finals[q]
                        kept.append(hyps[q])
                p += n

    def collect(self, c: Cohort, step_out, ending_rows: Tensor, ending: List[int], ids: List[int],
                scores: Scorer):
        """The stored hypotheses of the sentences that end, scored."""
        return self.score_finalized([c.finalized.pop(ids[s], []) for s in ending], scores)


class StayFinalizer(Finalizer):
    """Our rule (``--finalize stay``): finished entries stay on the beam; a sentence's output is the finished
    entries of its final beam."""

    def collect(self, c: Cohort, step_out, ending_rows: Tensor, ending: List[int], ids: List[int],
                scores: Scorer):
        """For each sentence in ``ending_rows``, the finished entries of its final beam as fairseq hypotheses.

        Returns [(hypotheses, their scores on the host)], one per sentence;
        one read for all of them.
        """
        sel, done_len = step_out.sel, step_out.done_len
        k, tokens, cum = self.k, c.tokens, c.scores
        done = sel.done.index_select(0, ending_rows)
        length = done_len.index_select(0, ending_rows)
        if c.mixed:
            # done_len holds the column after each hypothesis' EOS: its length from its own start (only the
            # finished entries' lengths are read).
            length = length - c.start.index_select(0, ending_rows).unsqueeze(1)
        final = sel.score.index_select(0, ending_rows)
        # Lengths and float32 scores are exact in the score type.
        flags, lens, finals = read_host(torch.stack([done.to(final.dtype), length.to(final.dtype), final]).view(3, -1))
        picked = [i for i, flag in enumerate(flags) if flag]
        flat = compact(done, len(picked))
        sentence = ending_rows.index_select(0, flat // k)
        rows = sentence * k + sel.parent.reshape(-1).index_select(0, sentence * k + flat % k)
        hyp_lens = [int(lens[i]) for i in picked]
        hyps = self.hypotheses(rows, length.view(-1).index_select(0, flat), hyp_lens,
                               final.view(-1).index_select(0, flat), tokens, cum,
                               c.start.index_select(0, sentence) if c.mixed else None)
        values, score_tensors = scores([finals[i] for i in picked], hyp_lens)
        collected = [([], []) for _ in range(ending_rows.numel())]
        for i, h, value, score in zip(picked, hyps, values, score_tensors):
            h["score"] = score
            collected[i // k][0].append(h)
            collected[i // k][1].append(value)
        return collected


def finalizer(finalize: str, k: int, eos: int) -> Finalizer:
    """The finalizer of the rule ``finalize`` (``fairseq`` or ``stay``) for a beam of ``k``."""
    return StayFinalizer(k, eos) if finalize == "stay" else FairseqFinalizer(k, eos)
