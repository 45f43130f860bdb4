"""A process spinning on one core beside a benchmark's runs: another job on a shared machine (issue 50).

The spinner exits by itself once the benchmark that started it has gone,
however it went. A benchmark killed with SIGTERM runs no ``finally``, and its
spinner used to outlive it and hold a core under every later measurement on
the machine: a bench_threads run of 2026-12-05 took 1.4x longer on one
thread and gave two threads 1.13x instead of 1.5x beside such a leftover.
"""

import contextlib
import subprocess
import sys
import time

# Checks its parent between short spins (about a millisecond each): re-parented means the benchmark is gone.
SPIN = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    for _ in range(20000):\n        pass\n"


@contextlib.contextmanager
def busy_core(on: bool = True, cpu=None):
    """Inside the block, a process spinning on core ``cpu`` (any core where None); nothing where not ``on``.

    Yields the spinner's ``Popen`` (None where not ``on``); it has spun for
    0.2 s when the block starts, and is killed and reaped when it ends.
    """
    if not on:
        yield None
        return
    prefix = ["taskset", "-c", str(cpu)] if cpu is not None else []  # taskset execs Python: still our child
    spinner = subprocess.Popen(prefix + [sys.executable, "-c", SPIN])
    try:
        time.sleep(0.2)
        yield spinner
    finally:
        spinner.kill()
        spinner.wait()
