"""Jacobi's calibrated default (``--jacobi-calibrate``): windows only where they pay, greedy's tokens always.

Decoding is real (the toy transformer); what is forced is the cost table
(a given :class:`Costs`, no clock), so each choice is deterministic. The one
test that measures writes its cache under a temporary folder.
"""

import contextlib
import copy
import json
import logging
import os
import signal
import threading
from pathlib import Path

import pytest
import torch

from conftest import parse_generate_args, sorted_batches
from fairseq_stream import cpu_info
from fairseq_stream.decoder import BeamDecoder
from fairseq_stream.errors import FairseqStreamError
from fairseq_stream.jacobi import calibration
from fairseq_stream.jacobi.calibration import FIRST_PROBE, MIN_CALLS, Chooser, Costs, RowCosts
from fairseq_stream.jacobi.decoder import JacobiDecoder, check_options


def greedy_decoder(models, task):
    return BeamDecoder(models, task.target_dictionary, beam_size=1, runner="lean", output_layer="auto",
                       keep_reference=False)


def tokens(dec, models, batches):
    out = {}
    with torch.no_grad():
        for s in batches:
            out.update((i, h[0]["tokens"].tolist()) for i, h in zip(s["id"].tolist(), dec.generate(models, s)))
    return out


def table(window_steps):
    """Costs where a greedy step is 1 ms and a window call of w positions a row costs ``window_steps(w)`` ms."""
    return Costs({r: RowCosts(1.0, 0.0, [(r * w, window_steps(w)) for w in (1, 2, 3)], 0.0) for r in (1, 2)},
                 hardware="given")


def batches_of(task):
    """Batches of 1 and of 2 sentences (the CPU's default runs windows at those only); ids repeat."""
    return sorted_batches(task, 1, 16, subset="valid") + sorted_batches(task, 2, 40, subset="valid")


@pytest.mark.parametrize("window_steps,greedy_batches", [(lambda w: 0.01, 0), (lambda w: 10.0 * w, "all")],
                         ids=["windows-pay", "windows-never-pay"])
def test_forced_choices_give_greedys_tokens(loaded, caplog, window_steps, greedy_batches):
    models, task = loaded("transformer")
    batches = batches_of(task)
    expected = tokens(greedy_decoder(models, task), models, batches)
    dec = JacobiDecoder(greedy_decoder(models, task), calibrate="auto", costs=table(window_steps))
    with caplog.at_level(logging.INFO, logger="fairseq_stream.jacobi.calibration"):
        assert tokens(dec, models, batches) == expected
    s = dec.stats.summary()
    if greedy_batches == "all":
        assert s["calibrated_greedy_batches"] == s["greedy_batches"] == len(batches)
        assert s["iterations"] == s["greedy_steps"]
        assert "running greedy's step" in caplog.text and "windows do not pay on this CPU" in dec.stats.log_line("j")
    else:
        assert s["greedy_batches"] == 0 and s["accepted_per_iteration"] > 1.0
        assert "replaces" in caplog.text and "running windows" in caplog.text
    assert s["greedy_steps"] == sum(len(expected[i]) for b in batches for i in b["id"].tolist())


def test_measured_calibration_is_cached_and_gives_greedys_tokens(loaded, tmp_path, monkeypatch, caplog):
    """A real calibration (whatever it finds on this machine), into a temporary cache, then read back."""
    monkeypatch.setenv("FAIRSEQ_STREAM_CACHE", str(tmp_path))
    models, task = loaded("transformer")
    batches = batches_of(task) + sorted_batches(task, 16, 200, subset="valid")
    expected = tokens(greedy_decoder(models, task), models, batches)
    with caplog.at_level(logging.INFO, logger="fairseq_stream.jacobi"):
        dec = JacobiDecoder(greedy_decoder(models, task), calibrate="auto")
        assert tokens(dec, models, batches) == expected
        assert dec.costs.source == "measured" and sorted(dec.costs.rows) == [1, 2]
        # The measuring is counted on its own, not as decoding.
        assert dec.stats.summary()["calibration_s"] >= dec.costs.seconds > 0
        assert "s measuring the cost of windows" in dec.stats.log_line("jacobi")
        cached = list((tmp_path / "jacobi-calibration").glob("*.json"))
        assert [str(p) for p in cached] == [dec.costs.path]
        again = JacobiDecoder(greedy_decoder(models, task), calibrate="auto")
        assert tokens(again, models, batches[:4]) == {i: expected[i] for i in tokens(again, models, batches[:4])}
        assert again.costs.source == "cache" and again.costs.rows == dec.costs.rows
        assert again.stats.summary()["calibration_s"] < dec.stats.summary()["calibration_s"]
    assert "jacobi: the cost of windows on {}".format(cpu_info.describe()) in caplog.text
    assert "read from {}".format(cached[0]) in caplog.text
    assert "jacobi: batches of 1 sentence: " in caplog.text


def test_explicit_settings_run_as_asked(loaded):
    models, task = loaded("transformer")

    def calibrated(**opts):
        return JacobiDecoder(greedy_decoder(models, task), **opts).calibrated

    assert calibrated(calibrate="auto") and not calibrated(calibrate="off") and not calibrated()
    assert not calibrated(block=3, calibrate="auto") and not calibrated(variant="pgj", calibrate="auto")
    assert calibrated(block=3, calibrate="on") and calibrated(variant="pj", draft="pad", calibrate="on")
    with pytest.raises(FairseqStreamError, match="--jacobi-calibrate must be one of auto, on, off, got sometimes"):
        check_options("hgj", None, "ngram", None, calibrate="sometimes")
    assert parse_generate_args(["DATA", "--user-dir", "fairseq_stream", "--search", "jacobi",
                                "--jacobi-calibrate", "off"]).jacobi_calibrate == "off"


def test_chooser_switches_by_the_ledger_and_probes_less_and_less():
    # A greedy step 1 ms; a window call of 1/2/3 positions 1.2/1.4/1.5 ms.
    chooser = Chooser(table(lambda w: {1: 1.2, 2: 1.4, 3: 1.5}[w]), widths=[2, 3])
    assert chooser.windows(1)  # nothing seen yet: windows, to count what they accept
    # Windows of 3 positions that accept one token a call: 1.5 ms a token against greedy's 1.
    while chooser.ledgers[1].seen_calls < MIN_CALLS:
        chooser.saw_windows(1, [10], [(1, 3)] * 10)
    choices = [chooser.windows(1) for _ in range(3 * FIRST_PROBE + 3)]
    # Greedy, a window batch after FIRST_PROBE greedy ones, then after twice as many.
    probes = [i for i, c in enumerate(choices) if c]
    assert probes == [FIRST_PROBE, 3 * FIRST_PROBE + 1]
    # The pool has learnt: windows of 3 accept 2.5 tokens a call (1.5 ms for 2.5 greedy steps).
    for _ in range(20):
        chooser.saw_windows(1, [10], [(1, 3)] * 4)
    assert all(chooser.windows(1) for _ in range(5))
    # Two sentences a call: an uncalibrated batch size runs as asked.
    assert chooser.windows(8)
    # Greedy's counterfactual follows the batch as its sentences end: 3 steps at 2 rows, 2 more at 1.
    assert chooser.costs.greedy_batch(2, [3, 5]) == pytest.approx(5.0)


def test_cpu_info_and_the_cache_location(monkeypatch, tmp_path):
    assert cpu_info.level_from_flags(frozenset({"avx2", "fma", "avx512f", "avx512_vnni"})) == "avx512_vnni"
    assert cpu_info.level_from_flags(frozenset({"avx2", "fma", "avx512f"})) == "avx512f"
    assert cpu_info.level_from_flags(frozenset({"avx2", "fma"})) == "avx2"
    assert cpu_info.level_from_flags(frozenset({"sse4_2"})) == "portable"
    # ATEN_CPU_CAPABILITY narrows the level (our kernels follow torch's cap), never widens it.
    assert cpu_info.capped("avx512_vnni", {"ATEN_CPU_CAPABILITY": "avx2"}) == "avx2"
    assert cpu_info.capped("avx512f", {"ATEN_CPU_CAPABILITY": "default"}) == "portable"
    assert cpu_info.capped("avx2", {"ATEN_CPU_CAPABILITY": "avx512"}) == "avx2"
    assert cpu_info.capped("avx512_vnni", {}) == "avx512_vnni"
    assert cpu_info.simd_level() in ("avx512_vnni", "avx512f", "avx2", "portable") and cpu_info.cpu_model()
    assert calibration.cache_base({"FAIRSEQ_STREAM_CACHE": "/y", "XDG_CACHE_HOME": "/x"}) == tmp_path.anchor / \
        tmp_path.__class__("y")
    assert calibration.cache_base({"XDG_CACHE_HOME": "/x"}) == tmp_path.__class__("/x/fairseq-stream")
    sig = dict(hardware="AMD EPYC (avx2)", shapes=[])
    other = dict(sig, hardware="Intel Xeon (avx512_vnni)")
    env = {"FAIRSEQ_STREAM_CACHE": str(tmp_path)}
    assert calibration.cache_file(sig, env).parent == tmp_path / "jacobi-calibration"
    assert calibration.cache_file(sig, env) != calibration.cache_file(other, env)


# -- the cache is a hint: anything wrong with it is one warning line and a new measurement ----------------------


@pytest.fixture(scope="module")
def good_cache(loaded, tmp_path_factory):
    """(cache folder, the cache file, its JSON): a real calibration on this machine, whatever it found."""
    base = tmp_path_factory.mktemp("calibration-cache")
    models, task = loaded("transformer")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FAIRSEQ_STREAM_CACHE", str(base))
        dec = JacobiDecoder(greedy_decoder(models, task), calibrate="auto")
        tokens(dec, models, batches_of(task)[:1])
    path = Path(dec.costs.path)
    return base, path, json.loads(path.read_text())


def run_on_cache(loaded, base, monkeypatch, caplog):
    """Calibrated Jacobi decoding with the cache under ``base``: (the decoder, its warning lines).

    Its tokens must be greedy's whatever the cache holds.
    """
    monkeypatch.setenv("FAIRSEQ_STREAM_CACHE", str(base))
    models, task = loaded("transformer")
    batches = batches_of(task)
    expected = tokens(greedy_decoder(models, task), models, batches)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        dec = JacobiDecoder(greedy_decoder(models, task), calibrate="auto")
        assert tokens(dec, models, batches) == expected
    return dec, [r.getMessage() for r in caplog.records
                 if r.levelno >= logging.WARNING and r.name.startswith("fairseq_stream")]


def with_row(good, **fields):
    data = copy.deepcopy(good)
    data["costs"]["rows"]["1"].update(fields)
    return data


WRONG_CACHES = {
    "a list": (lambda good: [1, 2, 3], "it is not a calibration"),
    "null": (lambda good: None, "it is not a calibration"),
    "a string": (lambda good: "hello", "it is not a calibration"),
    "no costs": (lambda good: {"signature": good["signature"]}, "its costs are not a table with rows"),
    "rows as a list": (lambda good: dict(good, costs=dict(good["costs"], rows=list(good["costs"]["rows"].values()))),
                       "its costs are not a table with rows"),
    "greedy_step abc": (lambda good: with_row(good, greedy_step="abc"),
                        "its row 1's greedy_step is 'abc', not a finite number > 0"),
    "greedy_step 0": (lambda good: with_row(good, greedy_step=0),
                      "its row 1's greedy_step is 0, not a finite number > 0"),
    "window_calls []": (lambda good: with_row(good, window_calls=[]), "its row 1's window_calls is [], not a list"),
    "a window call of one number": (lambda good: with_row(good, window_calls=[[1.0]]), "is not (positions, ms)"),
    "window_batch missing": (lambda good: with_row(good, window_batch=None), "its row 1's window_batch is None"),
    "a batch size missing": (lambda good: dict(good, costs=dict(good["costs"], rows={"1": good["costs"]["rows"]["1"]})),
                             "its batch sizes are [1], not [1, "),
    "another signature": (lambda good: dict(good, signature=dict(good["signature"], threads=-1)),
                          "it was written for another model, device or setting"),
}


@pytest.mark.parametrize("name", list(WRONG_CACHES))
def test_a_cache_of_the_wrong_shape_is_one_warning_and_a_new_measurement(loaded, good_cache, monkeypatch, caplog,
                                                                         name):
    base, path, good = good_cache
    wrong, why = WRONG_CACHES[name]
    path.write_text(json.dumps(wrong(good)))
    dec, warnings = run_on_cache(loaded, base, monkeypatch, caplog)
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("jacobi: ignoring the calibration cache {} (".format(path))
    assert why in warnings[0] and warnings[0].endswith("; measured again and cached")
    assert dec.costs.source == "measured" and dec.costs.path == str(path)
    # Rewritten with the new measurement: the next run reads it.
    assert Costs.from_json(json.loads(path.read_text())["costs"], "cache", None).rows == dec.costs.rows


def test_a_cache_that_is_not_json_is_one_warning(loaded, good_cache, monkeypatch, caplog):
    base, path, _ = good_cache
    path.write_bytes(b'{"signature": \xff')
    dec, warnings = run_on_cache(loaded, base, monkeypatch, caplog)
    assert len(warnings) == 1 and "(it is not JSON: " in warnings[0], warnings
    assert dec.costs.source == "measured"


@contextlib.contextmanager
def fails_if_it_hangs(seconds=120):
    """A blocking open() of a FIFO raises here instead of hanging the test run forever (the main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def hung(signum, frame):
        raise TimeoutError("still running after {} s: blocked on the FIFO?".format(seconds))

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_fifo_in_the_caches_place_is_never_opened_to_wait(loaded, good_cache, monkeypatch, caplog):
    base, path, _ = good_cache
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    with fails_if_it_hangs():
        dec, warnings = run_on_cache(loaded, base, monkeypatch, caplog)
    assert warnings == ["jacobi: ignoring the calibration cache {} (it is a FIFO, not a regular file); measured "
                        "again and cached".format(path)]
    assert path.is_file() and dec.costs.path == str(path)


def test_a_directory_in_the_caches_place_leaves_no_temporary_file(loaded, good_cache, monkeypatch, caplog):
    base, path, _ = good_cache
    path.unlink(missing_ok=True)
    path.mkdir()
    try:
        for _ in range(2):  # every run measures again, and none leaves a file behind
            dec, warnings = run_on_cache(loaded, base, monkeypatch, caplog)
            assert len(warnings) == 1, warnings
            assert warnings[0].startswith("jacobi: ignoring the calibration cache {} (it is a directory, not a "
                                          "regular file); measured again, and could not cache it (".format(path))
            assert dec.costs.source == "measured" and dec.costs.path is None
            assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
    finally:
        path.rmdir()
