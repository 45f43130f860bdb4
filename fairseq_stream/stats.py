"""Decoding counters shared by every decoder: timesteps, expansions, time per step.

The names follow Yang et al. (2020), Table 5: *timesteps* are decoder calls,
*expansions* are hypotheses run through the decoder (rows summed over steps),
*expansions per step* their ratio.
"""

import atexit
import json
import logging
import os
import statistics
import time
from collections import defaultdict
from typing import Optional

logger = logging.getLogger("fairseq_stream")


class DecodeStats:
    """Accumulates counters over a run; optionally keeps every step's rows and time.

    Args:
        keep_steps: also record (length, rows, seconds) for each step, for
            plots such as step time against current length.
        nbest: the hypotheses a sentence the tools print (``--nbest``): the
            sentences that got fewer (the pruning searches narrow the final
            beam) are counted and named in one warning at the end.
    """

    def __init__(self, keep_steps: bool = False, nbest: int = 1):
        self.sentences = 0
        self.nbest = nbest
        self.short_nbest = 0  # sentences with fewer hypotheses than nbest
        self.timesteps = 0
        self.expansions = 0
        self.wall_s = 0.0
        # The first generate call's start and the last one's end (perf_counter): the decode's wall window.
        # generate's own seconds (wall_s) miss what runs between calls; with --cpu-workers that is decoding
        # (the workers run ahead while fairseq-generate prints), so only the window compares layouts.
        self.window_start: Optional[float] = None
        self.window_end: Optional[float] = None
        self.refills = 0  # streaming: times the pool was refilled
        self.peak_lag = 0  # streaming: most decoder calls a sentence was passed over (latency guard)
        self.peak_cached = 0  # fairseq-generate's look-ahead: most finished results held for later batches
        self.keep_steps = keep_steps
        self.steps = []

    def add_step(self, length: int, rows: int, seconds: float):
        """One decoder call over ``rows`` hypotheses whose prefixes have ``length`` tokens."""
        self.timesteps += 1
        self.expansions += rows
        if self.keep_steps:
            self.steps.append((length, rows, seconds))

    def add_sentences(self, count: int, seconds: float, hypotheses=None):
        """``count`` sentences finished in a ``generate`` call lasting ``seconds``; ``hypotheses``: their n-best
        lists (any iterable of lists), to count those shorter than ``nbest``."""
        self.sentences += count
        if hypotheses is not None and self.nbest > 1:
            self.short_nbest += sum(len(h) < self.nbest for h in hypotheses)
        self.wall_s += seconds
        now = time.perf_counter()
        if self.window_start is None:
            self.window_start = now - seconds
        self.window_end = now

    def summary(self) -> dict:
        """The counters as a JSON-able dict (the ``--stats-file`` content)."""
        out = {
            "sentences": self.sentences,
            "timesteps": self.timesteps,
            "expansions": self.expansions,
            "expansions_per_step": self.expansions / self.timesteps if self.timesteps else 0.0,
            "wall_s": round(self.wall_s, 6),
            "window_s": round(self.window_end - self.window_start, 6) if self.window_start is not None else 0.0,
            "refills": self.refills,
            "peak_lag": self.peak_lag,
            "peak_cached": self.peak_cached,
            "short_nbest": self.short_nbest,
        }
        if self.keep_steps:
            out["steps"] = [
                {"length": length, "rows": rows, "seconds": round(sec, 7)}
                for length, rows, sec in self.steps
            ]
            by_length = defaultdict(list)
            for length, _, sec in self.steps:
                by_length[length].append(sec)
            out["median_step_s_by_length"] = {
                str(length): statistics.median(v) for length, v in sorted(by_length.items())
            }
        return out

    def log_line(self, name: str) -> str:
        s = self.summary()
        return (
            "{}: {} sentences, {} timesteps, {} expansions, {:.1f} expansions/step, "
            "{:.2f}s in decoding, {:.2f}s from the first batch's start to the last one's end".format(
                name, s["sentences"], s["timesteps"], s["expansions"],
                s["expansions_per_step"], s["wall_s"], s["window_s"],
            )
        )

    def write(self, path: str):
        """Write the summary as JSON, atomically (readers never see half a file)."""
        tmp = "{}.tmp{}".format(path, os.getpid())
        with open(tmp, "w") as f:
            json.dump(self.summary(), f, indent=1)
            f.write("\n")
        os.replace(tmp, path)


class StatsReporter:
    """Writes ``--stats-file`` and logs the totals when the process exits.

    fairseq-generate gives a generator no end-of-run hook, so the totals are
    written from ``atexit`` (``update`` writes them earlier on request).
    """

    def __init__(self, name: str, stats: DecodeStats, path: Optional[str]):
        self.name, self.stats, self.path = name, stats, path
        atexit.register(self.close)
        self._closed = False

    def update(self):
        if self.path:
            self.stats.write(self.path)

    def close(self):
        if self._closed:
            return
        self._closed = True
        self.update()
        if self.stats.sentences:
            logger.info(self.stats.log_line(self.name))
        if self.stats.short_nbest:
            logger.warning("fairseq-stream: %d of %d sentences got fewer than --nbest %d hypotheses: --search %s's "
                           "pruning keeps fewer finished ones in a sentence's final beam (docs/pruning.md)",
                           self.stats.short_nbest, self.stats.sentences, self.stats.nbest, self.name)
