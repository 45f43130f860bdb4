"""No background thread is left inside a torch operator when the interpreter finalizes (issue 49, item 7).

Such a thread aborts the process ("terminate called without an active
exception", exit status 134; see fairseq_stream/exit_threads.py). It once
ended ``fairseq-generate --search beam --min-len 300`` (fairseq's assertion
on the first batch while fairseq's data-loading thread still fetched the
others). Each test makes the race certain rather than likely: the main
thread exits only once the background thread has begun a product that
outlasts the exit, and an object freed late in the interpreter's
finalization keeps the interpreter there until the product ends. Without the
joins at exit the thread then takes the GIL back inside the operator during
finalization, every time.
"""

import subprocess
import sys

import pytest

from conftest import REPO, tool_env

# Shared by the scripts: a product long enough to outlast the exit, a producer that says when it
# begins one, and the object that holds the finalizing interpreter until the product has ended.
PRELUDE = """
import builtins, threading, time, torch
import fairseq_stream  # the plugin as --user-dir loads it: its patches of fairseq
a = torch.randn(1536, 1536)
began = time.perf_counter(); a.mm(a); product_s = time.perf_counter() - began
inside = threading.Event()

def products():
    while True:
        inside.set()  # the producer holds the GIL from here until the product releases it
        yield a.mm(a).sum()

class Linger:
    def __del__(self):  # runs while the interpreter finalizes: the product ends meanwhile
        time.sleep(3 * product_s + 0.5)

builtins.linger = Linger()
"""

EXIT = """
next(items)
inside.clear()
inside.wait()  # set again by the producer as it begins its next product
print("exiting", flush=True)
"""

OUR_READ_AHEAD = """
from fairseq_stream.schedule.read_ahead import ReadAhead
items = ReadAhead(products(), 1)
"""

FAIRSEQ_DATA_LOADING = """
from fairseq.data.iterators import BufferedIterator

class Batches:
    def __len__(self):
        return 1000

    def __iter__(self):
        return products()

items = BufferedIterator(1, Batches())
"""


@pytest.mark.parametrize("thread", [OUR_READ_AHEAD, FAIRSEQ_DATA_LOADING], ids=["read-ahead", "fairseq-consumer"])
def test_a_thread_inside_a_torch_operator_at_exit_is_joined_not_aborted(thread):
    proc = subprocess.run([sys.executable, "-c", PRELUDE + thread + EXIT], cwd=str(REPO), env=tool_env(),
                          capture_output=True, text=True, timeout=300)
    assert "terminate called" not in proc.stderr
    assert (proc.returncode, proc.stdout) == (0, "exiting\n"), proc.stderr[-3000:]
