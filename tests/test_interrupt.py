"""Ctrl-C in fairseq-generate with our search ends with one line and status 130, no traceback (one process;
the CPU workers' Ctrl-C is tested in test_workers.py), and a program that builds our generator itself keeps
its own Ctrl-C."""

import os
import signal
import subprocess
import time

from conftest import BIN, REPO, tool_env
from fairseq_stream import interrupt


def test_ctrl_c_in_one_process_ends_with_one_line_and_status_130(toy):
    # var-stream: the pool and its encoder thread, which must stop on the way out too.
    search = ["--search", "var-stream", "--beam", "5"]
    # Every sentence forced to 150 tokens: the decode runs long enough to be interrupted mid-way.
    argv = [str(BIN / "fairseq-generate"), str(toy.data_bin), "--path", str(toy.transformer), "--user-dir",
            "fairseq_stream", "--gen-subset", "valid", "--batch-size", "8", "--cpu", "--min-len", "150",
            "--max-len-b", "150", "--cpu-workers", "1"] + search
    proc = subprocess.Popen(argv, cwd=REPO, env=dict(tool_env(), OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    seen = ""
    for line in proc.stderr:
        seen += line
        if "fairseq-stream: using" in line:  # our generator is built: the decode begins
            break
    time.sleep(1.5)
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal does: the whole process group
    out, rest = proc.communicate(timeout=120)
    assert proc.returncode == 130, seen + rest
    assert interrupt.INTERRUPTED in rest.splitlines()  # the run's counters may follow it, logged at exit
    assert "Traceback" not in rest
    assert "Generate valid" not in out  # it ended before the last batch, not after


def test_a_program_building_the_generator_keeps_its_own_ctrl_c():
    # pytest is such a program: the handler is not installed here.
    before = signal.getsignal(signal.SIGINT)
    assert not interrupt.in_fairseq_tool()
    assert interrupt.exit_on_ctrl_c() is False
    assert signal.getsignal(signal.SIGINT) is before


def test_registered_stops_run_before_the_line_and_their_handler_goes_back(capsys):
    # The CPU workers' way in: their stop runs first, their words end the line, and withdrawing the last
    # stop puts back the handler found before (pytest's here).
    before = signal.getsignal(signal.SIGINT)
    stopped = []
    withdraw_outer = interrupt.stop_first(lambda: stopped.append("outer"), "; outer")
    withdraw_inner = interrupt.stop_first(lambda: stopped.append("inner"), "; inner")
    assert getattr(signal.getsignal(signal.SIGINT), "_fairseq_stream", False)
    withdraw_inner()
    assert getattr(signal.getsignal(signal.SIGINT), "_fairseq_stream", False)  # the outer stop still holds it
    withdraw_outer()
    withdraw_outer()  # twice is harmless (close after an error, then at exit)
    assert signal.getsignal(signal.SIGINT) is before

    interrupt.stop_first(lambda: stopped.append("workers"), "; the CPU workers are stopped")
    try:
        interrupt.interrupted()
    except SystemExit as e:
        assert e.code == 130
    finally:
        signal.signal(signal.SIGINT, before)
    assert stopped == ["workers"]
    assert capsys.readouterr().err == "fairseq-stream: interrupted; the CPU workers are stopped\n"
