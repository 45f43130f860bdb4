"""How a cohort opens and moves from one step to the next: the bookkeeping around the search's choice.

:func:`open_cohort` encodes a batch into a cohort at step 0 (a function of
the decoder, :class:`~fairseq_stream.decoder.BeamDecoder`: it reads its
``beam_size``, ``dense``, ``pad``, ``eos``, ``score_dtype``,
``max_lengths``, ``host_lag`` and its ``runner``'s ``start`` and
``reserve_positions``). :class:`BeamBookkeeping` is the engine's
:class:`~fairseq_stream.engine.Bookkeeping` for beam search: after a
search step it reads the step's summary, has the finalizer keep and collect
hypotheses, and moves the cohort to its next beam (:func:`next_beam`: slots
follow their parents, ended sentences leave, the runner's rows follow).
:func:`next_beam` reads ``beam_size``, ``dense`` and the ``runner``
(``reorder``, ``sync_free``) of what it is handed: the bookkeeping.
"""

import math
from typing import Callable, Dict, List, Optional

import torch
from torch import Tensor

from fairseq_stream import lengths
from fairseq_stream.cohort import Cohort
from fairseq_stream.finalize import Finalizer, read_host, to_device
from fairseq_stream.ops.beam_step import reorder_beam_
from fairseq_stream.ops.packing import compact


def open_cohort(d, net_input, ids: Optional[Tensor] = None, bos_token=None) -> Cohort:
    """Encode a fairseq batch into a cohort at step 0; ``ids`` name its sentences (default 0..S-1)."""
    src_tokens = net_input["src_tokens"]
    device = src_tokens.device
    k = d.beam_size
    S0 = src_tokens.size(0)
    if ids is None:
        ids = torch.arange(S0)
    # Ids handed on the host (fairseq-generate's look-ahead, the API's batches) stay known there through
    # splits and joins (Cohort.ids_host): no step reads them back from the device.
    ids_host = ids.tolist() if ids.device.type == "cpu" else None
    ids = to_device(ids, device) if ids_host is not None else ids.to(device)
    src_lengths = (src_tokens.ne(d.eos) & src_tokens.ne(d.pad)).long().sum(dim=1)
    max_lens = d.max_lengths(src_tokens)
    max_steps = int(max_lens.max().item()) if S0 else 0
    # A lagged read (late_reads.py) steps a sentence up to host_lag calls past its end: room for them.
    lag = getattr(d, "host_lag", 0)
    # A runner whose step is captured keeps its memory's shape for the decode (runners/step_graphs.py).
    reserve = getattr(d.runner, "reserve_positions", None)
    if reserve is not None:
        reserve(max_steps + 1 + lag)
    state = d.runner.start(net_input, k if d.dense else 1, ids)
    tokens = torch.full((S0 * k, max_steps + 2 + lag), d.pad, dtype=torch.long, device=device)
    tokens[:, 0] = d.eos if bos_token is None else bos_token
    live = torch.zeros(S0, k, dtype=torch.bool, device=device)
    live[:, 0] = True
    cohort = Cohort(
        k=k, pad=d.pad, step=0, ids=ids, ids_host=ids_host,
        tokens=tokens,
        scores=torch.zeros(S0 * k, max_steps + 1 + lag, dtype=d.score_dtype, device=device),
        live=live,
        done_len=torch.zeros(S0, k, dtype=torch.long, device=device),
        max_lens=max_lens,
        empty=src_lengths.eq(0),
        best_finished=torch.full((S0,), -math.inf, dtype=d.score_dtype, device=device),
        run_rows=torch.empty(0, dtype=torch.long, device=device),
        state=state,
    )
    cohort.run_rows = rows_to_run(d.dense, live)
    return cohort


class BeamBookkeeping:
    """What follows a beam search step (:class:`~fairseq_stream.engine.Bookkeeping`): the finished sentences'
    hypotheses, and the cohort moved to its next beam.

    Args:
        k: the beam width.
        dense: every slot is a runner row.
        runner: the runner whose rows follow the slots.
        finalizer: the finalization rule's (:func:`fairseq_stream.finalize.finalizer`).
        scores: the hypotheses' scorer (``BeamDecoder.scores``, as a function that holds no decoder).
        stats: the decoder's counters (the late reader's clock).
        late: the late reader (:mod:`~fairseq_stream.late_reads`), or None: each summary read at once.
    """

    def __init__(self, k: int, dense: bool, runner, finalizer: Finalizer, scores: Callable, stats, late=None):
        self.beam_size, self.dense, self.runner = k, dense, runner
        self.finalizer, self.scores, self.stats, self.late = finalizer, scores, stats, late

    def update(self, c: Cohort, step_out) -> Dict[int, List[Dict[str, Tensor]]]:
        """Carry ``c``'s search step ``step_out`` out, in place: the finalizer's part, then the next beam.

        Returns the sentences that finished (id -> hypotheses, best first);
        they leave the cohort. The step is tensor operations but for one
        read of a small summary (which sentences end, their ids, how many
        rows stay live and, under ``--finalize fairseq``, how many hypotheses
        each finalized): the only host synchronization of a step in which no
        sentence ends. A step in which some end also reads their hypotheses.
        """
        if self.late is not None:
            # The summary of a step made host_lag calls before is read instead (late_reads.py).
            return self.late.update(self, c, step_out)
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
        # fairseq's rule stores its EOS hypotheses now (the stay rule keeps them on the beam: nothing to store).
        self.finalizer.after_step(step_out.sel, c, ids, summary[2 * S: 3 * S])
        results = self.finalizer.finished(c, step_out, ending, ids, summary, self.scores) if ending else {}
        rows = summary[-S:] if per_sentence else None
        next_beam(self, c, step_out, ending, summary[-S - 1] if per_sentence else summary[-1], rows)
        return results


def reserve_pool(d, first: Cohort, sentences: int, copies: int, longest_source: Optional[int] = None):
    """Size the runner's memory once for a decode, at its first batch ``first``, where the runner has a
    ``reserve`` (the static-slot runner's pool): ``sentences`` held at once and ``copies`` more copied at once
    (the scheduler's :meth:`~fairseq_stream.engine.Planner.held`), ``beam_size`` rows each, of the positions the
    max length rule gives the input's ``longest_source`` (None: unknown, ``first``'s; with ``--max-len-a`` 0 the
    same), and encoder keys of that source length. A variable-width search runs at most ``beam_size`` rows a
    sentence too (its pruning only drops rows), so the same bound holds for it: reserved once, a captured step
    keeps its pool through the decode."""
    reserve = getattr(d.runner, "reserve", None)
    if reserve is None:
        return
    # open_cohort's columns: the longest maximum length + 2 + the lag; its rows hold one fewer position.
    positions = first.tokens.size(1) - 1
    if longest_source:
        longest = lengths.longest_max_len(longest_source, d.max_len_a, d.max_len_b, d.max_len)
        positions = max(positions, longest + 1 + getattr(d, "host_lag", 0))
    reserve(d.beam_size * (sentences + copies), sentences, positions, longest_source or 0)


def next_beam(d, c: Cohort, step_out, ending: List[int], n_live: int, live_rows: Optional[List[int]] = None):
    """Move ``c`` to the next step: slot j of sentence s continues slot ``flat_parent``; ended sentences
    leave; the runner's rows follow (``live_rows``: each sentence's live rows, where the runner takes
    them)."""
    device, k, S, step = c.tokens.device, d.beam_size, c.size, c.step
    sel, flat_parent, extended = step_out.sel, step_out.flat_parent, step_out.extended
    if d.dense:
        # As fairseq: every slot takes the candidate picked for it, also one that cannot go on (-inf where
        # the beam is wider than the words at step 0, or an EOS forced in); left as it was, the slot would
        # extend its old prefix (padding, score 0) and outrank every real hypothesis.
        extended = torch.ones_like(extended)
    new_token, new_score = sel.token.view(-1), sel.score.view(-1)
    tokens, scores, live, done_len, run_rows = c.tokens, c.scores, sel.live, step_out.done_len, c.run_rows
    if ending:
        keep = compact(~step_out.finished_now, S - len(ending))
        rows_keep = (keep.unsqueeze(1) * k + torch.arange(k, device=device)).view(-1)
        flat_parent = flat_parent.index_select(0, rows_keep)
        # Whole rows in one copy: the columns not written yet are padding in every row.
        tokens, scores = tokens.index_select(0, flat_parent), scores.index_select(0, flat_parent)
        extended, new_token, new_score = (t.index_select(0, rows_keep) for t in (extended, new_token, new_score))
        live, done_len = live.index_select(0, keep), done_len.index_select(0, keep)
        c.ids, c.max_lens = c.ids.index_select(0, keep), c.max_lens.index_select(0, keep)
        c.empty, c.best_finished = c.empty.index_select(0, keep), c.best_finished.index_select(0, keep)
        gone = set(ending)
        if c.ids_host is not None:
            c.ids_host = [i for s, i in enumerate(c.ids_host) if s not in gone]
        if c.mixed:
            c.start = c.start.index_select(0, keep)
            c.start_host = [a for s, a in enumerate(c.start_host) if s not in gone]
        tokens[:, step + 1] = torch.where(extended, new_token, tokens[:, step + 1])
        scores[:, step] = torch.where(extended, new_score, scores[:, step])
    else:
        # In place; only the columns written so far need moving.
        reorder_beam_(tokens, scores, flat_parent, extended, new_token, new_score, step)
    c.tokens, c.scores, c.live, c.done_len = tokens, scores, live, done_len
    c.step = step + 1
    if ending or not d.dense:  # dense, no sentence gone: every row still runs, in order
        c.run_rows = rows_to_run(d.dense, live, None if d.dense else n_live)
    if d.dense:
        order = flat_parent  # every slot is a runner row
    else:
        # The runner holds one row per previous run row.
        prev_row = torch.full((S * k,), -1, dtype=torch.long, device=device)
        prev_row.index_copy_(0, run_rows, torch.arange(run_rows.numel(), device=device))
        order = prev_row.index_select(0, flat_parent.index_select(0, c.run_rows))
    # One row per sentence (greedy) and none gone: every row continues itself, nothing to move.
    if c.size and not (d.dense and k == 1 and not ending):
        if getattr(d.runner, "sync_free", False):
            # The runner moves its rows by each sentence's count instead of reading them back.
            gone = set(ending)
            rows = [0 if s in gone else (k if d.dense else live_rows[s]) for s in range(S)]
            d.runner.reorder(c.state, order, sentence_rows=rows)
        else:
            d.runner.reorder(c.state, order)


def rows_to_run(dense: bool, live, n_live: Optional[int] = None):
    """Rows to run through the decoder: all slots when dense, else the ``n_live`` live ones.

    Without ``n_live`` (a new cohort) the live rows are counted, a host sync.
    """
    if dense:
        return torch.arange(live.numel(), device=live.device)
    if n_live is None:
        return live.view(-1).nonzero().flatten()
    return compact(live, n_live)
