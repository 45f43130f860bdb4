"""Reading a step's summary N decoder calls late (``--host-lag N``): on a GPU the host never waits on the step it
just launched.

The bookkeeping's update (:meth:`~fairseq_stream.cohort_steps.BeamBookkeeping.update`)
reads one small summary a step: which sentences end, their ids, how many
hypotheses each finalized. Read at once, the host waits for the step it has
just queued, so on a GPU the device idles while the host decides what comes
next. With a lag of N the update hands its step here instead
(:meth:`LateReads.update`): the summary stays on the device (CUDA: copied
non-blocking into pinned memory, with an event), and the summary of the step
made N decoder calls before is read. Until the host has read that a sentence
ended, its rows keep stepping: they run, are selected and reordered like any
other, but nothing of theirs is read (their later summaries are ignored,
what they finalize later is dropped) and their slots stay theirs. Once read,
the sentence is finalized from the step it ended at, from a copy of that
step's prefixes and selection kept for it (:class:`_Snapshot`: the cohort's
tokens are reordered in place afterwards), and its rows leave at its
cohort's next update.

It holds where a sentence's rows do not depend on other sentences and their
number is fixed: the dense searches (greedy, fixed width with ``--finalize
fairseq``), whose every slot is a row. There a sentence's arithmetic is that
of its own rows, so the output is the lag-0 output where the products do not
change with the number of rows (float64; float32 with rows padded to one
bucket: ``--static-buckets``). Variable-width searches and ``--finalize
stay`` run only their live hypotheses, a count the host reads each step:
:func:`check` refuses them.

Sentence ids key everything read late (the finalized hypotheses, the ended
sentences), since the stream pool splits and joins cohorts between a step
and its read.
"""

from collections import deque
from dataclasses import replace
from typing import Dict, List, Optional

import torch
from torch import Tensor

from fairseq_stream.cohort import Cohort
from fairseq_stream.cohort_steps import next_beam
from fairseq_stream.errors import FairseqStreamError
from fairseq_stream.finalize import to_device

# Runners whose rows of a sentence are independent of other sentences' and that move rows without reading
# the device (``sync_free``): a lagged read changes no arithmetic there.
LAG_RUNNERS = ("static", "lean")


def check(lag: int, dense: bool, runner_name: Optional[str], wrapped: bool = False):
    """One-line errors for a ``--host-lag`` that does not hold for this search, runner (None: not known yet)
    or decoder (``wrapped``: Jacobi's)."""
    if lag < 0:
        raise FairseqStreamError("--host-lag must be 0 or more, got {}".format(lag))
    if not lag:
        return
    if not dense:
        raise FairseqStreamError("--host-lag {} needs a search whose rows per sentence are fixed (greedy, fixed "
                                 "with --finalize fairseq): this one's change from step to step".format(lag))
    if runner_name is not None and runner_name not in LAG_RUNNERS:
        raise FairseqStreamError("--host-lag {} needs --runner static or lean (got {})".format(lag, runner_name))
    if wrapped:
        raise FairseqStreamError("--host-lag is not for Jacobi decoding (its windows read every call)")


def reader(lag: int, dense: bool, runner_name: Optional[str]) -> Optional["LateReads"]:
    """A decoder's late reader for ``lag`` (checked: :func:`check`), or None where it reads at once (0)."""
    check(lag, dense, runner_name)
    return LateReads(lag) if lag else None


class _Snapshot:
    """What a step's finalization reads of its cohort, as it was at that step (the cohort moves on in place
    before the host reads the step): the prefixes written so far, the step, the starts (mixed lengths)."""

    def __init__(self, c: Cohort, finalized: Dict[int, list]):
        self.step = c.step
        # The finalizer reads tokens up to column step + 1 and scores up to column step.
        self.tokens = c.tokens[:, : c.step + 2].clone()
        self.scores = c.scores[:, : c.step + 1].clone()
        self.start, self.start_host = c.start, c.start_host
        self.finalized = finalized

    @property
    def mixed(self) -> bool:
        return self.start is not None


def _host_copy(t: Tensor) -> Tensor:
    """``t`` copied to the host as it is now: on CUDA into pinned memory without waiting (the read waits for the
    step's event), on the CPU the same copy."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
    host.copy_(t, non_blocking=True)
    return host


class _Pending:
    """A step not read yet: its summary and what its finalization reads, copied to the host in one buffer (with
    an event after the copy on CUDA), its selection and its snapshot, and the decoder call that made it.

    The buffer holds, after the summary, the step's EOS flags and cumulative scores of the best k candidates
    (``sel.eos_mask``, ``sel.top_score``: fairseq's rule), all in float64 (the summary's integers and float32
    scores are exact there), so that scoring a sentence that ends reads this step's copy, not the device behind
    the step just launched, and a step stays one read.
    """

    def __init__(self, call: int, step_out, snapshot: _Snapshot):
        self.call, self.step_out, self.snapshot = call, step_out, snapshot
        summary, sel = step_out.summary, step_out.sel
        self.size = summary.numel()
        parts = [summary]
        if getattr(sel, "eos_mask", None) is not None:
            parts += [sel.eos_mask.reshape(-1), sel.top_score.reshape(-1)]
        self.host = _host_copy(torch.cat([p.to(torch.float64) for p in parts]))
        self.ready = None
        if summary.is_cuda:
            self.ready = torch.cuda.Event()
            self.ready.record(torch.cuda.current_stream(summary.device))
        self.candidates: List[float] = []

    def read(self) -> List[int]:
        """The summary on the host: waits for its own step only (CUDA), not for the steps queued since."""
        if self.ready is not None:
            self.ready.synchronize()
        values = self.host.tolist()
        self.candidates = values[self.size:]
        return [int(v) for v in values[: self.size]]

    def finals(self) -> List[float]:
        """The cumulative scores of the hypotheses the step finalized, by sentence then rank (the order of
        ``compact(sel.eos_mask)``), from what :meth:`read` read."""
        half = len(self.candidates) // 2
        return [v for flag, v in zip(self.candidates[:half], self.candidates[half:]) if flag]


def _mask(positions: List[int], size: int, device) -> Tensor:
    """(size,) bool, True at ``positions`` (host numbers; on CUDA copied from pinned memory without waiting for
    the steps queued before it)."""
    mask = torch.zeros(size, dtype=torch.bool)
    mask[positions] = True
    return to_device(mask, device)


class LateReads:
    """A decoder's steps waiting to be read, ``lag`` decoder calls late; see the module docstring.

    The clock is the decoder's count of calls (``stats.timesteps``: one a
    call, whatever the cohorts in it). ``log`` records each read as (the
    call that made the step, the call that read it): what the tests check
    the lag by.
    """

    def __init__(self, lag: int):
        self.lag = lag
        self.pending: deque = deque()
        self.finalized: Dict[int, list] = {}  # fairseq's rule: the hypotheses each sentence finalized, by id
        # Sentences read as ended: id -> the call at which their rows left (None: still in a cohort).
        self.ended: Dict[int, Optional[int]] = {}
        self.holding = set()  # ids of the sentences in cohorts this reader has seen
        self.log: List[tuple] = []

    def update(self, d, c: Cohort, step_out) -> Dict[int, List[Dict[str, Tensor]]]:
        """``c``'s search step ``step_out`` kept for later; the steps now due read (their sentences that ended,
        id -> hypotheses, best first); ``c`` moved to its next beam without the sentences read as ended.

        ``d``: the bookkeeping (:class:`~fairseq_stream.cohort_steps.BeamBookkeeping`): its counters (the
        clock), finalizer and scorer, and what :func:`~fairseq_stream.cohort_steps.next_beam` reads."""
        ids, now = self._host_ids(c), d.stats.timesteps
        self.pending.append(_Pending(now, step_out, _Snapshot(c, self.finalized)))
        results: Dict[int, List[Dict[str, Tensor]]] = {}
        while self.pending and self.pending[0].call <= now - self.lag:
            results.update(self._read(d, self.pending.popleft(), now))
        leaving = [s for s, i in enumerate(ids) if i in self.ended and self.ended[i] is None]
        if leaving:
            step_out = replace(step_out, finished_now=_mask(leaving, c.size, c.tokens.device))
            for s in leaving:
                self.ended[ids[s]] = now
                self.holding.discard(ids[s])
        # Dense: every slot runs, so neither the live count nor each sentence's rows are read.
        next_beam(d, c, step_out, leaving, c.rows)
        self._forget(now)
        return results

    def _host_ids(self, c: Cohort) -> List[int]:
        """``c``'s sentence ids on the host: known from its opening where they were handed on the host (and
        kept through splits, joins and departures), else read once for the cohort."""
        if c.ids_host is None:
            c.ids_host = c.ids.tolist()
        self.holding.update(c.ids_host)
        return c.ids_host

    def _read(self, d, p: _Pending, now: int) -> Dict[int, List[Dict[str, Tensor]]]:
        """Read ``p``'s summary at call ``now``: store what its step finalized, collect the sentences that ended
        in it."""
        summary = p.read()
        self.log.append((p.call, now))
        S = (len(summary) - 1) // 3
        ids, n_final = summary[S: 2 * S], summary[2 * S: 3 * S]
        if any(n_final):
            d.finalizer.after_step(p.step_out.sel, p.snapshot, ids, n_final, p.finals())
            for i, n in zip(ids, n_final):
                if n and i in self.ended:  # finalized after its sentence ended: nothing reads it
                    self.finalized.pop(i, None)
        ending = [s for s in range(S) if summary[s] & 1 and ids[s] not in self.ended]
        if not ending:
            return {}
        step_out = replace(p.step_out, finished_now=_mask(ending, S, p.snapshot.tokens.device))
        results = d.finalizer.finished(p.snapshot, step_out, ending, ids, summary, d.scores)
        for s in ending:
            self.ended[ids[s]] = None
        return results

    def _forget(self, now: int):
        """Drop what no pending step can name any more: every record once no sentence is held (a decode's
        end; ids may start again at 0), else the ended sentences whose rows left before the oldest pending
        step was made."""
        if not self.holding:
            self.pending.clear()
            self.ended.clear()
            self.finalized.clear()
            return
        oldest = self.pending[0].call if self.pending else now + 1
        for i in [i for i, left in self.ended.items() if left is not None and left < oldest]:
            del self.ended[i]
