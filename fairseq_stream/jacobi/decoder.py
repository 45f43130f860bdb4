"""The Jacobi decoding loop: greedy's tokens, several verified per decoder call.

Greedy decoding solves ``y[t+1] = argmax p(. | y[0..t], x)`` for t = 0, 1, ...
one equation per decoder call. A Jacobi iteration instead feeds a *window*:
the last verified token ``y[P]`` and draft guesses ``d[1..W-1]`` for the
positions after it, in one multi-token call over the cached verified prefix
(:mod:`fairseq_stream.runners.lean_window`). Output ``g[0]`` is exact (all
its inputs are verified); ``g[j]`` is exact as long as every draft before it
was right (``d[i] == g[i-1]`` for i <= j). The iteration accepts all of those
tokens (the paper accepts one): at least one per call, so never more calls
than greedy, and exactly greedy's tokens, whatever the drafts hold.

The output layer is greedy's, applied at every window position with that
position's own rules: PAD never chosen, ``--unkpen``, EOS banned below
``--min-len`` and forced at the sentence's maximum length (no oracle target
length: a row ends where greedy would, at its first accepted EOS).

Variants (how wide a row's window is; ``b`` = ``--jacobi-block``):

* ``pj``: the whole rest of the sentence, to its maximum length (Algorithm 1);
* ``pgj``: the rest of the current block of b positions (blocks at multiples
  of b, Algorithm 2); a block's last position is a plain greedy step;
* ``hgj``: b positions from the verified prefix on, up to ``--jacobi-horizon``
  tokens (default: the whole sentence), greedy steps after it (Algorithm 3:
  parallel blocks, then autoregressive). Without ``--jacobi-block``, b is
  ``AUTO_BLOCK``: 3 while a call decodes one sentence, 2 when several share it
  (the fastest of each measured on the CPU).

With ``pad`` drafts (and for ``pj``) every row runs its variant's whole window,
as in the paper. With ``ngram`` drafts ``pgj`` and ``hgj`` run at most that
window: a row drafts only the tokens whose chance of acceptance pays for their
positions in this call (:meth:`JacobiDecoder._threshold`), so a row with no
likely draft runs one position, a greedy step, and a batch mostly of such rows
costs about what greedy's step costs. With ``--jacobi-candidates k`` (k > 1) a
row's window may be a tree: the pool's k most frequent continuations, sharing
their first tokens, each position kept only where it pays as above; the
iteration accepts the longest branch that the model verifies.

One call serves a whole fairseq batch: each row has its own verified length,
window start and width; finished sentences leave the batch. Per iteration the loop
reads the window's argmax tokens and values back once (the only host sync),
which it needs anyway to accept tokens and draft the next window. The loop
is the engine's (:class:`~fairseq_stream.engine.Engine` with the batch
planner, as greedy's batch): a batch's rows are its one cohort, and an
iteration is the step it asks for (:class:`_WindowSteps`), through the
engine's three interfaces: the window call is the model call, greedy's
acceptance of the verified tokens the search policy (:class:`_GreedyAcceptance`),
the rows' caches and next drafts the bookkeeping (:class:`_WindowBooks`).
"""

import collections
import math
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import numpy as np
import torch
from torch import Tensor

from fairseq_stream.decoder import check_call
from fairseq_stream.engine import Engine
from fairseq_stream.errors import FairseqStreamError
from fairseq_stream.hypotheses import empty_hypothesis, hypothesis
from fairseq_stream.jacobi import calibration
from fairseq_stream.jacobi.drafts import DRAFTS, AcceptanceRates, NgramPool, likely_tree, next_draft
from fairseq_stream.jacobi.interface import GreedyDecoder
from fairseq_stream.runners.lean import LeanRunner
from fairseq_stream.runners.lean_window import WindowRunner, depths
from fairseq_stream.schedule.plan import BatchPlanner
from fairseq_stream.stats import DecodeStats

VARIANTS = ("pj", "pgj", "hgj")
# The n-gram pool's continuation length for pj, whose window has no block size.
PJ_DRAFT_SPAN = 8
# A decoder call's fixed cost in window positions (what one more position costs), per device:
# :meth:`JacobiDecoder._threshold`. CPU: the Multi30k transformer's window call on one Xeon thread,
# 0.97 ms for one position, + 0.059 ms a position at 64 rows (docs/BENCHMARKS.md, issue 12). CUDA:
# a call's ~10 ms of host time against rows that are nearly free below hundreds (issue 10).
CALL_COST = {"cpu": 15.0, "cuda": 200.0}
# The draft threshold from which a whole batch runs greedy's step (JacobiDecoder._greedy_pays), per
# device: rows / (rows + call_cost) >= t, i.e. rows >= call_cost * t / (1 - t). CPU: from 3 rows at
# the default cost. With the skinny product (ops/product.py) a call of up to 4 positions
# reads the weights once, as greedy's step of up to 4 rows does; 2 sentences' windows of 2 fit,
# 3 sentences' do not. Multi30k transformer, one Xeon thread (docs/HISTORY.md, Jacobi):
# windows at 2 sentences a call 1.12x greedy, at 4 0.77x (at 3 0.87x in a same-run check).
# CUDA: rows >= call_cost / 2.
GREEDY_THRESHOLD = {"cpu": 0.15, "cuda": 1.0 / 3.0}
# hgj's block without --jacobi-block, for a call of one sentence and of several (pgj's: 2). Multi30k
# transformer, one Xeon thread (docs/HISTORY.md, the Jacobi runs): at batch 1 a fourth
# position verifies 1.32 tokens an iteration against 1.31 and costs more than that (b=4 1.09-1.13x
# greedy against b=3's 1.06-1.15x); two sentences' windows of 2 fit one pass of the skinny product.
AUTO_BLOCK = {"alone": 3, "shared": 2}
# Outputs of greedy-step batches kept for the n-gram pool until windows run again: the newest only.
# Learning an output costs about as much as two greedy steps of the toy model on one AVX2 core (the
# pool's bookkeeping in Python); where the calibration chose greedy's step, learning every output
# before each probing window batch cost more than the probes themselves (0.80x greedy against 1.05x).
UNLEARNED_KEPT = 16


def check_options(variant: str, block, draft: str, horizon, call_cost=None, candidates=1, calibrate="off"):
    """One-line errors for Jacobi's options (the command line checks them before loading models)."""
    if calibrate not in calibration.CALIBRATE:
        raise FairseqStreamError("--jacobi-calibrate must be one of {}, got {}".format(
            ", ".join(calibration.CALIBRATE), calibrate))
    if variant not in VARIANTS:
        raise FairseqStreamError("--jacobi-variant must be one of {}, got {}".format(", ".join(VARIANTS), variant))
    if draft not in DRAFTS:
        raise FairseqStreamError("--jacobi-draft must be one of {}, got {}".format(", ".join(DRAFTS), draft))
    if block is not None and int(block) < 1:
        raise FairseqStreamError("--jacobi-block must be at least 1, got {}".format(block))
    if horizon is not None and int(horizon) < 0:
        raise FairseqStreamError("--jacobi-horizon must be at least 0, got {}".format(horizon))
    if call_cost is not None and not float(call_cost) > 0:
        raise FairseqStreamError("--jacobi-call-cost must be positive, got {}".format(call_cost))
    if candidates is None or int(candidates) < 1:
        raise FairseqStreamError("--jacobi-candidates must be at least 1, got {}".format(candidates))
    if int(candidates) > 1 and (draft != "ngram" or variant == "pj"):
        raise FairseqStreamError("--jacobi-candidates above 1 needs --jacobi-draft ngram and --jacobi-variant "
                                 "pgj or hgj (got {} drafts, {})".format(draft, variant))


class JacobiStats:
    """Jacobi's counters on top of the greedy decoder's :class:`DecodeStats`.

    Window calls and greedy's own steps (batches too full for windows) are
    decoder calls of one run, so they count in one place: the greedy
    decoder's counters (``calls``), which this reads through (``timesteps``,
    ``add_step``, ...), its summary holding theirs and Jacobi's.
    ``timesteps`` are window calls and ``expansions`` window positions run
    (rows x width). ``iterations`` counts, per sentence, the calls it took
    part in; ``greedy_steps`` the calls greedy needs for it (its output
    length, EOS included); their ratio is the iteration speedup.
    ``accepted`` is the histogram of tokens accepted per row and iteration.
    ``greedy_batches`` counts batches too full for windows to pay, decoded
    by greedy's own step (their sentences count one token per iteration);
    ``calibrated_greedy_batches`` those of them where the calibration
    (``--jacobi-calibrate``) found that windows do not pay on this CPU.
    ``calibration_s`` is the time spent measuring the calibration's cost
    table on first use (seconds, once per model and device, then cached),
    kept out of the decoding time ``wall_s``.
    ``tree_windows`` counts rows' windows holding several candidates
    (``--jacobi-candidates``), ``off_chain`` those whose accepted tokens
    came from a candidate other than the first.
    """

    def __init__(self, calls: DecodeStats):
        self.calls = calls
        self.iterations = 0
        self.greedy_steps = 0
        self.greedy_calls = 0  # greedy's calls per batch: its longest output
        self.greedy_batches = 0  # batches decoded by greedy's own step (JacobiDecoder._greedy_pays)
        self.calibrated_greedy_batches = 0  # of them, those the calibration sent there (calibration.Chooser)
        self.calibration_s = 0.0  # measuring the cost table on first use (not in wall_s)
        self.accepted: Dict[int, int] = {}
        self.tree_windows = 0
        self.off_chain = 0

    def __getattr__(self, name):
        # DecodeStats' counters and methods: the greedy decoder's (not "calls" itself, unset in a copy).
        if name == "calls":
            raise AttributeError(name)
        return getattr(self.calls, name)

    write = DecodeStats.write  # this summary, as DecodeStats writes its own

    def add_accepted(self, counts: List[int]):
        for m in counts:
            self.accepted[m] = self.accepted.get(m, 0) + 1
        self.iterations += len(counts)

    def add_greedy_batch(self, results, chosen: bool) -> List[List[int]]:
        """Count a batch that greedy's own step decoded (``chosen``: the calibration sent it there) as
        iterations of one token each; its outputs' tokens (empty sources left out)."""
        outputs = [tokens for tokens in (hypos[0]["tokens"].tolist() for hypos in results) if tokens]
        for tokens in outputs:
            self.add_accepted([1] * len(tokens))
            self.greedy_steps += len(tokens)
        self.greedy_calls += max(map(len, outputs), default=0)
        self.greedy_batches += 1
        self.calibrated_greedy_batches += int(chosen)
        return outputs

    def summary(self) -> dict:
        """The greedy decoder's counters and Jacobi's, as a JSON-able dict (the ``--stats-file`` content)."""
        out = self.calls.summary()
        total = sum(m * n for m, n in self.accepted.items())
        out.update({
            "iterations": self.iterations,
            "greedy_steps": self.greedy_steps,
            "iteration_speedup": self.greedy_steps / self.iterations if self.iterations else 0.0,
            "greedy_calls": self.greedy_calls,
            "call_speedup": self.greedy_calls / self.timesteps if self.timesteps else 0.0,
            "accepted_per_iteration": total / self.iterations if self.iterations else 0.0,
            "accepted_histogram": {str(m): self.accepted[m] for m in sorted(self.accepted)},
            "greedy_batches": self.greedy_batches,
            "calibrated_greedy_batches": self.calibrated_greedy_batches,
            "calibration_s": self.calibration_s,
            "tree_windows": self.tree_windows,
            "off_chain": self.off_chain,
        })
        return out

    def log_line(self, name: str) -> str:
        s = self.summary()
        line = ("{}: {} sentences, {} iterations for {} greedy steps ({:.2f}x), {:.2f} tokens accepted "
                "per iteration, {} decoder calls for greedy's {}, {:.2f}s in decoding".format(
                    name, s["sentences"], s["iterations"], s["greedy_steps"], s["iteration_speedup"],
                    s["accepted_per_iteration"], s["timesteps"], s["greedy_calls"], s["wall_s"]))
        if s["tree_windows"]:
            line += " ({} windows held several candidates, {} accepted another than the first)".format(
                s["tree_windows"], s["off_chain"])
        static = s["greedy_batches"] - s["calibrated_greedy_batches"]
        if static:
            line += " ({} batches too full for windows to pay decoded by greedy's step; see --jacobi-call-cost)".format(
                static)
        if s["calibrated_greedy_batches"]:
            line += (" ({} batches decoded by greedy's step where windows do not pay on this CPU; see "
                     "--jacobi-calibrate)").format(s["calibrated_greedy_batches"])
        if s["calibration_s"] >= 0.05:
            line += " (and {:.1f}s measuring the cost of windows, once per model and device)".format(s["calibration_s"])
        return line


class _Row:
    """One sentence being decoded: its verified tokens, their log-probabilities and its draft."""

    __slots__ = ("index", "tokens", "lprobs", "draft", "parents", "estimates", "max_len", "trace")

    def __init__(self, index: int, bos: int, max_len: int, draft: List[int], trace: Optional[list]):
        self.index = index
        self.tokens = [bos]  # tokens[0] is BOS; tokens[P] the last verified one
        self.lprobs: List[float] = []
        self.draft = draft
        # The draft tokens' parents as window indices (0: the last verified token) when the draft
        # is a tree of candidates (--jacobi-candidates); None for a chain.
        self.parents: Optional[List[int]] = None
        self.estimates: List = []  # the draft's estimated chances (AcceptanceRates), sized drafts only
        self.max_len = max_len
        self.trace = trace

    def accept(self, window: List[int], tree: Optional[List[int]], outputs: List[int], values: List[float], eos: int,
               rates: AcceptanceRates, stats: "JacobiStats"):
        """Add to the row the tokens its window verified: (how many, their window indices in a tree or None,
        guesses).

        A chain accepts its outputs while the draft before each was right; a
        tree, the branch the model verifies (:func:`_accepted_path`). The
        guesses are the outputs after them, for the next draft.
        """
        width = len(window)
        if tree is None:
            m = 1
            while m < width and window[m] == outputs[m - 1] and outputs[m - 1] != eos:
                m += 1
            if self.estimates:
                rates.record(self.estimates, m - 1)
            path, guess = None, outputs[m:]
        else:
            path, guess = _accepted_path(window, tree, outputs, eos)
            m = len(path)
            stats.tree_windows += 1
            stats.off_chain += any(j != k for k, j in enumerate(path))
            on_path = set(path)
            rates.record(self.estimates, 0, [j + 1 in on_path for j in range(width - 1)])
        if self.trace is not None:
            self.trace.append({"start": len(self.tokens) - 1, "width": width, "accepted": m,
                               "tokens": outputs, "lprobs": values})
        self.tokens.extend(outputs[:m] if path is None else [outputs[j] for j in path])
        self.lprobs.extend(values[:m] if path is None else [values[j] for j in path])
        return m, path, guess

    def hypothesis(self, greedy: GreedyDecoder, device) -> Dict[str, Tensor]:
        """fairseq's hypothesis dict for the finished row, scored as greedy scores it."""
        dtype = np.float64 if greedy.score_dtype == torch.float64 else np.float32
        # Greedy accumulates in the score type, step by step, and takes positional
        # scores as differences of the running sums: the same here.
        cumulative = np.cumsum(np.asarray(self.lprobs, dtype=dtype), dtype=dtype)
        positional = np.diff(cumulative, prepend=dtype(0)).astype(dtype)
        tokens = self.tokens[1:]
        _, (score,) = greedy.scores([float(cumulative[-1])], [len(tokens)])
        return hypothesis(torch.tensor(tokens, dtype=torch.long, device=device),
                          torch.from_numpy(positional).to(device), score)


class JacobiDecoder:
    """A fairseq generator (``generate(models, sample)``) giving greedy's output by Jacobi iteration.

    Args:
        greedy: the greedy decoder this decoder reproduces (beam 1, on the
            lean runner; a :class:`~fairseq_stream.decoder.BeamDecoder`),
            reached through :class:`~fairseq_stream.jacobi.interface.GreedyDecoder`
            only: its length rules, output layer and score arithmetic are
            used as they are, its runner's models run the windows.
        variant: ``pj``, ``pgj`` or ``hgj``.
        block: b, the window of ``pgj`` and ``hgj`` (>= 1; 1 is greedy); None:
            ``hgj`` takes ``AUTO_BLOCK`` by how many sentences share a call, ``pgj`` 2.
        draft: ``pad`` (the paper: PAD, then each iteration's guesses) or
            ``ngram`` (first an n-gram pool of the run's outputs).
        horizon: ``hgj`` decodes by windows up to this many tokens, by
            greedy steps after (None: the whole sentence).
        trace_ids: sentence ids whose every iteration is recorded (DDGviz).
        call_cost: a decoder call's fixed cost in window positions, which
            decides how much ``ngram`` drafts (None: ``CALL_COST`` of the device).
        candidates: how many of the pool's continuations a row's draft may
            hold, as a tree (``ngram`` drafts, ``pgj`` and ``hgj``; 1: one
            chain). Sentences traced for DDGviz draft one chain.
        calibrate: ``auto`` (the command line's default): the default
            setting (``hgj`` without a block) runs windows only at batch
            sizes where they pay on this device, by a calibration of their
            cost cached per model and CPU and the acceptance seen in the
            run (:mod:`.calibration`), and greedy's step elsewhere; ``on``:
            so does any setting; ``off`` (this constructor's default):
            windows as the setting says.
        costs: a :class:`~.calibration.Costs` table to use instead of
            measuring (and caching) one.
    """

    def __init__(self, greedy: GreedyDecoder, variant: str = "hgj", block: Optional[int] = None, draft: str = "ngram",
                 horizon: Optional[int] = None, trace_ids=(), call_cost: Optional[float] = None,
                 candidates: int = 1, calibrate: str = "off", costs: Optional[calibration.Costs] = None):
        check_options(variant, block, draft, horizon, call_cost, candidates, calibrate)
        runner = _lean_runner_of(greedy)
        self.greedy = greedy
        self.variant = variant
        self.auto_block = block is None and variant == "hgj"
        self.block = int(block) if block is not None else (max(AUTO_BLOCK.values()) if self.auto_block else 2)
        self.horizon = None if horizon is None else int(horizon)
        self.call_cost = None if call_cost is None else float(call_cost)
        self.candidates = int(candidates)
        self.draft = draft
        # Explicit --jacobi-variant/--jacobi-block settings run as asked unless calibration is "on".
        self.calibrated = calibrate == "on" or (calibrate == "auto" and variant == "hgj" and block is None)
        self.costs = costs
        self.chooser: Optional[calibration.Chooser] = None  # built at the first batch (the device is known)
        self.calls: Optional[List] = None  # (rows, positions) of the current batch's calls, for the chooser
        self.windows = WindowRunner(runner)
        self.eos, self.pad = greedy.eos, greedy.pad
        span = PJ_DRAFT_SPAN if variant == "pj" else max(1, self.block - 1)
        self.pool = NgramPool(span, self.candidates) if draft == "ngram" else None
        self.rates = AcceptanceRates()
        # Outputs of batches run by greedy's step, for the pool (UNLEARNED_KEPT: the newest only).
        self.unlearned = collections.deque(maxlen=UNLEARNED_KEPT)
        self._checked = False  # the output layer's arguments (topk_log_softmax's check)
        self.trace_ids = set(int(i) for i in trace_ids)
        self.traces: Dict[int, dict] = {}
        self.stats = JacobiStats(greedy.stats)

    def cuda(self):
        self.greedy.cuda()
        return self

    @property
    def output_backend(self) -> str:
        """The output layer greedy uses (and so this decoder): "torch", "cpu" or "cuda"."""
        return self.greedy.output_backend

    # -- windows -----------------------------------------------------------

    def width(self, verified: int, max_len: int, rows: int = 1) -> int:
        """The window a row with ``verified`` tokens after BOS runs (1 = a greedy step) in a call of ``rows``."""
        remaining = max_len - verified + 1  # steps verified .. max_len (EOS forced at max_len)
        if self.variant == "pj":
            return remaining
        if self.variant == "pgj":
            return min(self.block - verified % self.block, remaining)
        if self.horizon is not None and verified >= self.horizon:
            return 1
        block = AUTO_BLOCK["alone" if rows == 1 else "shared"] if self.auto_block else self.block
        return min(block, remaining)

    # -- fairseq's generator interface ---------------------------------------

    @torch.no_grad()
    def generate(self, models, sample, prefix_tokens=None, constraints=None, bos_token=None, **kwargs):
        """Translate a fairseq sample; one list with greedy's hypothesis per sentence, in sample order."""
        check_call(prefix_tokens, constraints)
        start = time.perf_counter()
        net_input = sample["net_input"]
        src_tokens = net_input["src_tokens"]
        ids = sample.get("id")
        ids = ids.tolist() if ids is not None else list(range(src_tokens.size(0)))
        rows, device = src_tokens.size(0), src_tokens.device
        traced = bool(self.trace_ids.intersection(ids))
        if self._greedy_pays(rows, device) and not traced:
            return self._greedy_batch(models, sample, prefix_tokens, constraints, bos_token, **kwargs)
        calibration_start = time.perf_counter()
        chooser = self._chooser(device) if self.calibrated else None
        # A first use's calibration is not decoding: counted on its own (calibration_s), not in wall_s.
        calibrating = time.perf_counter() - calibration_start
        self.stats.calibration_s += calibrating
        start += calibrating
        if chooser is not None and not traced and not chooser.windows(rows):
            results = self._greedy_batch(models, sample, prefix_tokens, constraints, bos_token, chosen=True,
                                         **kwargs)
            chooser.saw_greedy(rows, _lengths(results))
            return results
        self.calls = [] if chooser is not None else None
        results = self.decode(net_input, ids, bos_token)
        if chooser is not None:
            chooser.saw_windows(rows, _lengths(results), self.calls)
            self.calls = None
        self.stats.add_sentences(len(results), time.perf_counter() - start)
        return results

    def _chooser(self, device) -> Optional[calibration.Chooser]:
        """The calibrated choice between windows and greedy's step (built, and measured or read, once).

        Calibrated batch sizes: those up to ``calibration.MAX_ROWS`` that
        the static rule (:meth:`_greedy_pays`) leaves to windows; widths:
        1 to the block (pj: to 4, extrapolated beyond).
        """
        if self.chooser is None:
            rows = [r for r in range(1, calibration.MAX_ROWS + 1) if not self._greedy_pays(r, device)]
            if not rows:
                return None
            widest = 4 if self.variant == "pj" else max(2, self.block)
            widths = list(range(1, widest + 1))
            if self.costs is None:
                self.costs = calibration.load_or_measure(self, device, rows, widths)
                calibration.log_costs(self.costs)
            self.chooser = calibration.Chooser(self.costs, widths[1:])
        return self.chooser

    def _greedy_pays(self, rows: int, device) -> bool:
        """Whether a batch this full is decoded by greedy's own step: windows would not pay.

        With ``ngram`` drafts (pgj, hgj) a draft token pays at chance
        ``_threshold(rows)``. That rule shares a call's fixed cost evenly
        among its rows, which holds for one sentence but flatters a batch,
        whose calls go on until its longest sentence ends; and on the CPU
        a call's cost grows by steps (one pass over the weights per 4
        positions), not by position. Measured (one Xeon thread, Multi30k
        transformer, the default block; docs/HISTORY.md, Jacobi):
        windows pay at 2 rows (1.12x greedy) and lose at 3 and 4
        (0.87x, 0.77x), and a window call of one position a row still costs a few
        percent more than greedy's step (the loop's bookkeeping in Python
        against a compiled search step). So from the device's
        ``GREEDY_THRESHOLD`` on the batch runs greedy's step: the same tokens
        by construction, at greedy's speed.
        """
        threshold = self._threshold(rows, device)
        return threshold is not None and threshold >= GREEDY_THRESHOLD.get(device.type, GREEDY_THRESHOLD["cuda"])

    def _greedy_batch(self, models, sample, prefix_tokens, constraints, bos_token, chosen=False, **kwargs):
        """Greedy's own decoding of a batch, counted as iterations of one token each (iteration speedup 1).

        ``chosen``: the calibration sent it here (counted apart).
        """
        results = self.greedy.generate(models, sample, prefix_tokens=prefix_tokens, constraints=constraints,
                                       bos_token=bos_token, **kwargs)
        outputs = self.stats.add_greedy_batch(results, chosen)
        if self.pool is not None:
            # Learnt when a batch runs windows (_learn): in a run of full batches, never.
            bos = self.eos if bos_token is None else int(bos_token)
            self.unlearned.extend([bos] + tokens for tokens in outputs)
        return results

    def decode(self, net_input, ids: List[int], bos_token=None) -> List[List[Dict[str, Tensor]]]:
        """Greedy's hypothesis (a one-entry list) for every sentence of ``net_input``, in its order."""
        greedy = self.greedy
        src_tokens = net_input["src_tokens"]
        device = src_tokens.device
        S = src_tokens.size(0)
        empty = ((src_tokens.ne(self.eos) & src_tokens.ne(self.pad)).long().sum(dim=1).eq(0)).tolist()
        max_lens = greedy.max_lengths(src_tokens).tolist()
        bos = self.eos if bos_token is None else int(bos_token)
        results: List[Optional[list]] = [None] * S
        rows = []
        for i in range(S):
            if empty[i]:
                # Greedy gives an empty source an empty hypothesis (fairseq would fail on it).
                results[i] = [empty_hypothesis(self.eos, device)]
                continue
            trace = [] if ids[i] in self.trace_ids else None
            rows.append(_Row(i, bos, max_lens[i], [], trace))
        self._learn()
        threshold = self._threshold(len(rows), device)
        for row in rows:
            self._draft(row, [], threshold, len(rows))
        state = None
        if rows:
            state = self.windows.start(net_input)
            if len(rows) < S:
                state = self.windows.keep(state, [r.index for r in rows])
        # The engine's loop with the batch planner, as greedy's batch: one cohort of rows, a window call a step.
        steps = _WindowSteps(self, ids, device)
        for index, hyps in Engine(steps, BatchPlanner()).run([_Windows(rows, state)]):
            results[index] = hyps
        self.stats.greedy_calls += steps.books.longest_output
        return results

    def _learn(self):
        """Add the outputs of batches run by greedy's step to the n-gram pool."""
        for tokens in self.unlearned:
            self.pool.add_output(tokens)
        self.unlearned.clear()

    def _threshold(self, rows: int, device) -> Optional[float]:
        """The chance of acceptance a draft token needs to pay for its window position, or None (fixed windows).

        An accepted token saves what a token costs (its position plus its
        share of a call's fixed cost, ``call_cost`` positions over the
        call's rows); a drafted one costs its position: worth drafting when
        ``chance * (1 + call_cost / rows) >= 1``. One sentence drafts nearly
        anything; a full CPU batch, only what is close to certain.
        """
        if self.pool is None or self.variant == "pj":
            return None
        call_cost = self.call_cost if self.call_cost is not None else CALL_COST.get(device.type, CALL_COST["cuda"])
        return rows / (rows + call_cost)

    def _draft(self, row: _Row, guesses: List[int], threshold: Optional[float], rows: int):
        """Set the row's next draft: a fixed window (``threshold`` None), or the tokens that pay for their positions."""
        context = row.tokens[-NgramPool.ORDERS[0]:]
        if threshold is None:
            row.draft = next_draft(guesses, self.pool, context, self._draft_room(row, rows), self.pad)
        else:
            count = self.candidates if row.trace is None else 1
            room = self._draft_room(row, rows)
            row.draft, row.parents, row.estimates = likely_tree(guesses, self.pool, context, room, threshold,
                                                                self.rates, count)

    def _draft_room(self, row: _Row, rows: int) -> int:
        """How many draft tokens the row's next window can take, in a call of ``rows``."""
        return max(0, self.width(len(row.tokens) - 1, row.max_len, rows) - 1)


@dataclass
class _Windows:
    """The engine's cohort for Jacobi: the rows still decoding and their window runner state."""

    rows: List[_Row]
    state: Any
    step: int = 0  # window calls made (the batch planner's plan reads it)

    @property
    def size(self) -> int:
        return len(self.rows)


@dataclass
class _WindowCall:
    """A window call's output (the model call of Jacobi's step): the windows and trees run, their layout, and
    greedy's argmax word and its value at every position; ``t0``: when the step began."""

    t0: float
    windows: List[List[int]]
    trees: List[Optional[List[int]]]
    layout: Any
    words: List[int]
    values: List[float]


@dataclass
class _Acceptance:
    """Jacobi's search step over a window call: each row's accepted count and tree path, and which rows go on
    (their indices and next guesses) or are done."""

    call: _WindowCall
    accepted: List[int]
    paths: Optional[List]
    keep: List[int]
    guesses: List[List[int]]
    done: List[_Row]


class _WindowSteps:
    """What the engine steps for Jacobi (:class:`~fairseq_stream.engine.Engine` with
    :class:`~fairseq_stream.schedule.plan.BatchPlanner`, which neither splits nor joins), as the engine's three
    parts (:class:`~fairseq_stream.engine.CohortSteps`): the model call is its own, one window call over a
    batch's rows with greedy's output layer at every position (:meth:`call_model`); the search policy greedy's
    acceptance of each row's verified tokens (:class:`_GreedyAcceptance`); the bookkeeping the rows' caches,
    next drafts and finished rows (:class:`_WindowBooks`)."""

    def __init__(self, jacobi: "JacobiDecoder", ids: List[int], device):
        self.jacobi = jacobi
        self.policy = _GreedyAcceptance(jacobi.eos, jacobi.rates, jacobi.stats)
        self.books = _WindowBooks(jacobi, ids, device)

    def call_model(self, cohorts: List[_Windows]) -> List[_WindowCall]:
        """One window call over the one cohort's rows, and greedy's output layer at every position."""
        (c,) = cohorts
        t0 = time.perf_counter()
        windows = [[r.tokens[-1]] + r.draft for r in c.rows]
        trees = [None if r.parents is None else [-1] + r.parents for r in c.rows]
        layout, words, values = self._run_windows(c.rows, c.state, windows, trees)
        return [_WindowCall(t0, windows, trees, layout, words, values)]

    def _run_windows(self, rows: List[_Row], state, windows, trees):
        """The window call and greedy's output layer at every position: (layout, argmax words, their values)."""
        jacobi = self.jacobi
        layout = jacobi.windows.layout(state, windows, trees if any(t is not None for t in trees) else None)
        logits = jacobi.windows.window(state, layout)
        # Each window position's depth after the verified prefix (its index, in a chain).
        levels = [depths(t) if t is not None else range(len(w)) for w, t in zip(windows, trees)]
        ban_eos, force_eos = _eos_rules(rows, levels, state.lengths, jacobi.greedy.min_len, layout.tokens.device)
        # The arguments are built here and keep their kinds: checked once per decoder.
        out = jacobi.greedy.top_candidates(logits, 1, ban_eos=ban_eos, force_eos=force_eos, check=not jacobi._checked)
        jacobi._checked = True
        words, values = _read_back(out.indices.view(-1), out.values.view(-1))
        return layout, words, values


class _GreedyAcceptance:
    """Jacobi's search policy (:class:`~fairseq_stream.engine.SearchPolicy`): greedy's choice at every window
    position, each row keeping the tokens its window verified; a row ends at its first accepted EOS."""

    def __init__(self, eos: int, rates: AcceptanceRates, stats):
        self.eos, self.rates, self.stats = eos, rates, stats

    def select(self, c: _Windows, call: _WindowCall) -> _Acceptance:
        """Each row's tokens that its window verified (added to the row), and the rows still decoding."""
        accepted, keep, done, guesses = [], [], [], []
        paths = [None] * len(c.rows) if any(t is not None for t in call.trees) else None
        offset = 0
        for i, r in enumerate(c.rows):
            width = len(call.windows[i])
            m, path, guess = r.accept(call.windows[i], call.trees[i], call.words[offset: offset + width],
                                      call.values[offset: offset + width], self.eos, self.rates, self.stats)
            offset += width
            accepted.append(m)
            if paths is not None:
                paths[i] = path
            if r.tokens[-1] == self.eos:
                done.append(r)
                continue
            keep.append(i)
            guesses.append(guess)
        return _Acceptance(call, accepted, paths, keep, guesses, done)


class _WindowBooks:
    """Jacobi's bookkeeping (:class:`~fairseq_stream.engine.Bookkeeping`): the step's counters, the verified
    tokens committed to the rows' caches, the survivors' next drafts; each finished row's hypothesis keyed by
    its index in the batch, its output learnt by the n-gram pool and its trace kept."""

    def __init__(self, jacobi: "JacobiDecoder", ids: List[int], device):
        self.jacobi, self.ids, self.device = jacobi, ids, device
        self.longest_output = 0  # the longest output's tokens: greedy's calls for the batch

    def update(self, c: _Windows, chosen: _Acceptance) -> Dict[int, List[Dict[str, Tensor]]]:
        """The step's counters, the rows' caches and next drafts; the rows that finished leave ``c``."""
        jacobi = self.jacobi
        c.rows, c.state = self._next_windows(c, chosen)
        c.step += 1
        finished = {}
        for row in chosen.done:
            finished[row.index] = [row.hypothesis(jacobi.greedy, self.device)]
            self.longest_output = max(self.longest_output, len(row.tokens) - 1)
            if jacobi.pool is not None:
                jacobi.pool.add_output(row.tokens)
            if row.trace is not None:
                jacobi.traces[self.ids[row.index]] = {"iterations": row.trace, "tokens": row.tokens[1:]}
        return finished

    def _next_windows(self, c: _Windows, chosen: _Acceptance):
        """The step counted, the verified tokens committed to the rows' caches and the survivors' next drafts
        made; returns (rows still decoding, their state)."""
        jacobi, layout = self.jacobi, chosen.call.layout
        jacobi.stats.add_accepted(chosen.accepted)
        jacobi.stats.add_step(max(layout.widths), layout.positions, time.perf_counter() - chosen.call.t0)
        if jacobi.calls is not None:
            jacobi.calls.append((len(c.rows), layout.positions))
        for r in chosen.done:
            jacobi.stats.greedy_steps += len(r.tokens) - 1
        # A row's cache holds every verified token but the last (the next window's input).
        jacobi.windows.commit(c.state, chosen.accepted, chosen.paths)
        survivors = [c.rows[i] for i in chosen.keep]
        threshold = jacobi._threshold(len(survivors), self.device)
        for r, guess in zip(survivors, chosen.guesses):
            jacobi._draft(r, guess, threshold, len(survivors))
        state = c.state
        if chosen.done and survivors:
            state = jacobi.windows.keep(state, chosen.keep)
        return survivors, state


def _lengths(results) -> List[int]:
    """Each output's tokens (EOS included), sentences with an empty source (no output) left out."""
    return [n for n in (len(hypos[0]["tokens"]) for hypos in results) if n]


def _eos_rules(rows: List[_Row], levels, lengths: List[int], min_len: int, device):
    """Per window position: EOS banned (below ``--min-len``), EOS forced (at the row's maximum length).

    ``levels[r]``: row r's window positions' depths after its verified
    prefix (a position's step is the row's length plus its depth). Each
    is None where no position of the call needs it, as in most
    iterations: known on the host, so no tensor is built for it.
    """
    ban = force = None
    if min(lengths) < min_len:
        ban = torch.tensor([length + j < min_len for d, length in zip(levels, lengths) for j in d],
                           device=device)
    if any(length + max(d) >= r.max_len for r, d, length in zip(rows, levels, lengths)):
        force = torch.tensor([length + j >= r.max_len for r, d, length in zip(rows, levels, lengths)
                              for j in d], device=device)
    return ban, force


def _read_back(words: Tensor, values: Tensor):
    """The window's argmax words and their log-probabilities as host lists: the iteration's one read.

    On a GPU in one tensor, one host sync (word indices are exact in float32
    below 2**24); on the CPU two ``tolist`` calls, which cost a tenth of
    stacking them.
    """
    if words.is_cpu:
        return words.tolist(), values.tolist()
    words, values = torch.stack([words.to(values.dtype), values]).tolist()
    return [int(w) for w in words], values


def _accepted_path(window: List[int], parents: List[int], outputs: List[int], eos: int):
    """A tree-shaped window's verified branch: (its window indices, the guesses after it).

    From the window's first position, follow the child whose draft token is
    the model's output at its parent, until none is or the output is EOS:
    each position on the path had only verified inputs, so its output is
    greedy's next token. The guesses are the outputs along the first
    children after the path (what a chain window passes on).
    """
    children: Dict[int, List[int]] = {}
    for j, p in enumerate(parents):
        if p >= 0:
            children.setdefault(p, []).append(j)
    path = [0]
    while outputs[path[-1]] != eos:
        nxt = next((c for c in children.get(path[-1], ()) if window[c] == outputs[path[-1]]), None)
        if nxt is None:
            break
        path.append(nxt)
    guesses, node = [], path[-1]
    while children.get(node):
        node = children[node][0]
        guesses.append(outputs[node])
    return path, guesses


class JacobiUnsupported(FairseqStreamError):
    """Jacobi decoding cannot run this model or option: ``--search jacobi REASON; use --search greedy``.

    The advice is for fairseq-generate's users; a tool that only draws Jacobi
    decoding (DDGviz) words it with ``reason`` alone.
    """

    def __init__(self, reason: str):
        super().__init__("--search jacobi {}; use --search greedy".format(reason))
        self.reason = reason


def _lean_runner_of(greedy: GreedyDecoder) -> LeanRunner:
    """The greedy decoder's runner, which the windows run on; a one-line error where Jacobi cannot use it."""
    runner = greedy.runner
    if not isinstance(runner, LeanRunner):
        raise JacobiUnsupported("runs fairseq transformers on the lean runner only (this model: {})".format(
            _why_not_lean(runner)))
    if greedy.repeat_ngram_blocker is not None:
        raise JacobiUnsupported("does not support --no-repeat-ngram-size")
    return runner


def _why_not_lean(runner) -> str:
    from fairseq_stream.runners.lean import unsupported_reason

    from fairseq_stream.runners import retained_dropout

    members = runner.model.models
    reason = next((r for r in map(unsupported_reason, members) if r), None)
    dropout = retained_dropout(members)
    if not reason and dropout:
        return "--retain-dropout keeps dropout while decoding ({}), which only the fairseq runner applies".format(
            dropout)
    return reason or "--runner {} was asked for".format(getattr(runner, "name", "fairseq"))
