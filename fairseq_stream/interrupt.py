"""Ctrl-C in the command-line tools: one line and exit status 130, never a traceback from inside fairseq.

A KeyboardInterrupt raised wherever SIGINT lands (inside our decode, in
fairseq-generate's printing between two batches, in fairseq's data loader)
would end fairseq-generate with fairseq's traceback and status -2. The
handler here, installed when our generator is built for a fairseq tool,
prints one line and raises ``SystemExit(130)``, as the bulk tool ends: ``finally`` blocks still
run on the way out (the encoder thread is stopped, exit joins the threads
left: :mod:`fairseq_stream.exit_threads`). The CPU workers hand it their
stop (:func:`stop_first`) while they run, so the one handler stops them
before it ends the process, and take it back when they close.

Only in a fairseq tool's process, and only from its main thread: a program
that builds a generator itself (the Python API, ``task.build_generator`` in
a notebook, the tests) keeps its own Ctrl-C.
"""

import contextlib
import os
import signal
import sys
from typing import Callable, List, Tuple

INTERRUPTED = "fairseq-stream: interrupted"

# What must stop before the process ends (the CPU workers), newest first, with
# the words it adds to the line and the SIGINT handler to put back after it.
_stops: List[Tuple[Callable[[], None], str, object]] = []
# The process that installed the handler. A process forked from it (fairseq's DataLoader worker) inherits
# the handler; there SIGINT is Python's KeyboardInterrupt, and the line is the parent's alone.
_owner = {"pid": None}


def in_fairseq_tool() -> bool:
    """Whether this process is one of fairseq's command-line tools (``fairseq-generate``, ``python -m
    fairseq_cli.interactive``, our ``fairseq-stream-generate``), not a program that builds a generator."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    script = os.path.basename(getattr(main, "__file__", None) or "")
    return script.startswith("fairseq-") or getattr(spec, "name", "").startswith("fairseq_cli.")


def _ignored() -> bool:
    """Whether SIGINT is ignored: inherited so (a background job of a shell script, whose Ctrl-C is not the
    job's), or set so by :func:`interrupted` on the way out. A handler installed then would undo it."""
    return signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def exit_on_ctrl_c() -> bool:
    """Install the one-line handler for SIGINT (once) in a fairseq tool's main thread; whether it is installed."""
    if getattr(signal.getsignal(signal.SIGINT), "_fairseq_stream", False):
        return True
    if not in_fairseq_tool() or _ignored():
        return False
    try:
        _install()
    except ValueError:  # not the main thread
        return False
    return True


def _install():
    """Make the one-line handler SIGINT's, owned by this process; the handler it replaced.

    Raises:
        ValueError: not called from the main thread.
    """
    before = signal.signal(signal.SIGINT, _interrupted)
    _owner["pid"] = os.getpid()
    return before


def stop_first(stop: Callable[[], None], words: str) -> Callable[[], None]:
    """Have Ctrl-C call ``stop`` before the one line (``INTERRUPTED`` + ``words``) and status 130; returns
    the function that withdraws it.

    The handler is installed for as long as ``stop`` is registered, in any
    program (a decode with CPU workers must stop them wherever Ctrl-C lands),
    and the handler found before is put back when the last one is withdrawn.
    From a thread other than the main one nothing is installed and the
    caller's own ``KeyboardInterrupt`` catch stays the only way. Where SIGINT is ignored nothing is
    installed either: no Ctrl-C comes.
    """
    if _ignored():
        return lambda: None
    try:
        before = _install()
    except ValueError:  # not the main thread
        return lambda: None
    entry = (stop, words, before)
    _stops.append(entry)

    def withdraw():
        if entry not in _stops:
            return
        _stops.remove(entry)
        try:
            signal.signal(signal.SIGINT, entry[2] if not _stops else _interrupted)
        except ValueError:  # withdrawn from another thread (at exit): the process is ending anyway
            pass
    return withdraw


@contextlib.contextmanager
def sigint_held():
    """Hold a Ctrl-C that comes during the block (a fork) until the block's end, then handle it as before.

    A SIGINT that lands inside ``os.fork`` raised KeyboardInterrupt in an
    after-fork hook (logging's), where Python reports it as "Exception
    ignored" and drops it: the run went on as if no Ctrl-C had come. Masking
    the signal does not hold it in a process with other threads (the kernel
    hands it to one of them, and the main thread still runs the handler
    inside the hook), so during the block the handler only records it. A
    process forked in the block inherits that recorder and must set its own.
    """
    caught = []
    try:
        before = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(frame))
    except ValueError:  # not the main thread: Python runs no handler here
        before = None
    try:
        yield
    finally:
        if before is not None:
            signal.signal(signal.SIGINT, before)
            if caught and callable(before):
                before(signal.SIGINT, caught[-1])
            elif caught and before == signal.SIG_DFL:
                os.kill(os.getpid(), signal.SIGINT)


def interrupted():
    """End the process as Ctrl-C does here: each registered stop, the one line, ``SystemExit(130)``."""
    try:  # a second Ctrl-C while the workers stop and the exit hooks run: ignored, not a second line and a traceback
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread
        pass
    words = ""
    while _stops:
        stop, words_of, _ = _stops.pop()
        words = words or words_of
        stop()
    print(INTERRUPTED + words, file=sys.stderr, flush=True)
    sys.exit(130)


def _interrupted(signum, frame):
    if os.getpid() != _owner["pid"]:
        # A forked helper (torch's DataLoader worker catches this and ends quietly): the parent says the line.
        raise KeyboardInterrupt
    interrupted()


_interrupted._fairseq_stream = True
