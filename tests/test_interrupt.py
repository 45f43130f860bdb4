"""Ctrl-C in fairseq-generate with our search ends with one line and status 130, no traceback (one process;
the CPU workers' Ctrl-C is tested in test_workers.py), and a program that builds our generator itself keeps
its own Ctrl-C."""

import os
import signal
import subprocess
import time

from conftest import BIN, REPO, tool_env
from fairseq_stream import interrupt


def ctrl_c_as_a_terminal_gives_it():
    """In the child before it runs: SIGINT's default, whatever the suite inherited. A suite started as a
    background job of a script has SIGINT ignored, and the tools keep an inherited ignore (a job's Ctrl-C is
    not theirs)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_in_one_process_ends_with_one_line_and_status_130(toy):
    # var-stream: the pool and its encoder thread, which must stop on the way out too.
    search = ["--search", "var-stream", "--beam", "5"]
    # Every sentence forced to 150 tokens: the decode runs long enough to be interrupted mid-way.
    argv = [str(BIN / "fairseq-generate"), str(toy.data_bin), "--path", str(toy.transformer), "--user-dir",
            "fairseq_stream", "--gen-subset", "valid", "--batch-size", "8", "--cpu", "--min-len", "150",
            "--max-len-b", "150", "--cpu-workers", "1"] + search
    proc = subprocess.Popen(argv, cwd=REPO, env=dict(tool_env(), OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=ctrl_c_as_a_terminal_gives_it)
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
    # Once: fairseq's DataLoader worker (--num-workers 1) inherited the handler and said it a second time.
    assert [line for line in rest.splitlines() if line.startswith(interrupt.INTERRUPTED)] == [interrupt.INTERRUPTED]
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
    # stop puts back the handler found before (pytest's here). A suite started with SIGINT ignored (a
    # background job) would keep it ignored, and nothing would be installed: Python's own handler first.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
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
        signal.signal(signal.SIGINT, inherited)
    assert stopped == ["workers"]
    assert capsys.readouterr().err == "fairseq-stream: interrupted; the CPU workers are stopped\n"


def run_as_a_fairseq_tool(tmp_path, body, **popen):
    """``body`` run as a script named like a fairseq tool (``interrupt.in_fairseq_tool`` says so for it)."""
    import sys

    script = tmp_path / "fairseq-fake-tool"
    script.write_text("import os, signal, sys, time\nfrom fairseq_stream import interrupt\n" + body)
    popen.setdefault("preexec_fn", ctrl_c_as_a_terminal_gives_it)
    return subprocess.run([sys.executable, str(script)], cwd=REPO, env=tool_env(), capture_output=True, text=True,
                          timeout=120, **popen)


def test_ctrl_c_before_our_handler_is_one_line_not_fairseqs_traceback(tmp_path):
    """Ctrl-C while fairseq loads the data and the models (before the generator's handler is set) ended with
    a 20-frame traceback from inside hydra or fairseq."""
    proc = run_as_a_fairseq_tool(tmp_path, "import fairseq_stream\nraise KeyboardInterrupt\n")
    assert proc.returncode in (130, -signal.SIGINT), proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == interrupt.INTERRUPTED
    assert "Traceback" not in proc.stderr


def test_a_program_of_its_own_keeps_its_ctrl_c_traceback(tmp_path):
    import sys

    script = tmp_path / "mine.py"
    script.write_text("import fairseq_stream\nraise KeyboardInterrupt\n")
    proc = subprocess.run([sys.executable, str(script)], cwd=REPO, env=tool_env(), capture_output=True, text=True,
                          timeout=120)
    assert "Traceback" in proc.stderr and interrupt.INTERRUPTED not in proc.stderr


def test_a_second_ctrl_c_while_stopping_is_ignored(tmp_path):
    """Two Ctrl-C in a row printed the line twice, then an exit hook's traceback (SystemExit: 130)."""
    body = ("interrupt.exit_on_ctrl_c()\n"
            "def stop():\n"
            "    os.kill(os.getpid(), signal.SIGINT)  # the second Ctrl-C, while the first one's stop runs\n"
            "    time.sleep(0.3)\n"
            "interrupt.stop_first(stop, '; stopped')\n"
            "os.kill(os.getpid(), signal.SIGINT)\n"
            "time.sleep(10)\n")
    proc = run_as_a_fairseq_tool(tmp_path, body)
    assert proc.returncode == 130, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-1] == interrupt.INTERRUPTED + "; stopped"
    assert sum(interrupt.INTERRUPTED in line for line in lines) == 1 and "Traceback" not in proc.stderr


def test_an_inherited_ignored_ctrl_c_stays_ignored(tmp_path):
    """A background job of a shell script starts with SIGINT ignored; installing our handler made it end."""
    body = ("assert not interrupt.exit_on_ctrl_c()\n"
            "withdraw = interrupt.stop_first(lambda: None, '; stopped')\n"
            "os.kill(os.getpid(), signal.SIGINT)\n"
            "time.sleep(0.2)\n"
            "print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)\n")
    proc = run_as_a_fairseq_tool(tmp_path, body, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "True"
