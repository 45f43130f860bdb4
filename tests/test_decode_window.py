"""The decode's wall window (first generate call's start to the last one's end), which benchmarks compare
layouts by: it holds every generate call's time and what ran between the calls."""

import time

from fairseq_stream.schedule.workers import add_counters, counters_of, counters_since
from fairseq_stream.stats import DecodeStats


def test_the_window_holds_the_calls_and_the_gaps_between_them():
    stats = DecodeStats()
    assert stats.summary()["window_s"] == 0.0
    for seconds in (0.02, 0.01):
        start = time.perf_counter()
        time.sleep(seconds)
        stats.add_sentences(3, time.perf_counter() - start)
        time.sleep(0.01)  # fairseq-generate printing between calls: in the window, not in wall_s
    s = stats.summary()
    assert s["sentences"] == 6 and s["window_s"] >= s["wall_s"] > 0
    assert "s from the first batch's start to the last one's end" in stats.log_line("fixed")


def test_a_workers_window_stays_its_own():
    # A worker's stats were forked from the parent's: its window must not be added to the parent's.
    parent, worker = DecodeStats(), DecodeStats()
    parent.add_sentences(2, 0.5)
    before = counters_of(worker)
    worker.add_sentences(4, 0.25)
    worker.add_step(3, 8, 0.01)
    add_counters(parent, counters_since(worker, before))
    assert (parent.sentences, parent.timesteps) == (2, 1)
    assert parent.window_start is not None and parent.window_end < worker.window_end
