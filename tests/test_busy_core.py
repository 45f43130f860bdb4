"""The benchmarks' busy core (benchmarks/busy_core.py): a spinner never outlives the benchmark that started it.

A benchmark killed with SIGTERM runs no ``finally``; a spinner left behind
would hold a core under every later measurement on the machine.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

from conftest import REPO

HOLDS_A_BUSY_CORE = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[1])
    from busy_core import busy_core
    with busy_core() as spinner:
        print(spinner.pid, flush=True)
        time.sleep(60)
""")


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting for its reaper counts as gone)."""
    try:
        with open("/proc/{}/stat".format(pid)) as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_spinner_exits_when_its_benchmark_is_killed():
    bench = subprocess.Popen([sys.executable, "-c", HOLDS_A_BUSY_CORE, str(REPO / "benchmarks")],
                             stdout=subprocess.PIPE, text=True)
    try:
        spinner = int(bench.stdout.readline())
        assert running(spinner)
        bench.send_signal(signal.SIGTERM)
        bench.wait(timeout=10)
        deadline = time.monotonic() + 10
        while running(spinner) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not running(spinner), "the spinner outlived its benchmark"
    finally:
        bench.kill()
        bench.wait()


def test_no_spinner_where_the_core_is_not_asked_for():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from busy_core import busy_core
    finally:
        sys.path.pop(0)
    with busy_core(False) as spinner:
        assert spinner is None
    with busy_core(True, sorted(os.sched_getaffinity(0))[0]) as spinner:
        assert running(spinner.pid)
    assert spinner.returncode is not None
