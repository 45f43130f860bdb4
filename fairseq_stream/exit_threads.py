"""Background threads stopped and joined at exit, before the interpreter finalizes.

A daemon thread still inside a torch operator when the interpreter
finalizes aborts the whole process: "terminate called without an active
exception", exit status 134. The operator releases the GIL while it runs and
takes it back in the destructor of pybind11's GIL guard; once the
interpreter finalizes, Python 3.11 ends a thread that asks for the GIL with
``pthread_exit``, whose unwinding cannot pass that ``noexcept`` destructor,
so ``std::terminate`` ends the process. fairseq-generate leaves such threads
running when it stops early (an error, Ctrl-C): fairseq's data-loading
thread (``BackgroundConsumer``, which calls torch operators for every batch
it fetches) and our encoder read-ahead.

``atexit`` handlers run before the interpreter finalizes, while threads
still run normally: :func:`join_at_exit` registers a thread with a function
that asks it to stop, and the handler asks every registered thread that is
still alive to stop and joins it.
"""

import atexit
import threading
import time
import weakref
from typing import Callable

# Seconds exit waits, in all, for the threads to finish the item they are making (an encoder
# forward, a batch from a data-loading worker); a thread still running after that is left to
# the interpreter, as before.
EXIT_JOIN_S = 30.0
# How often exit asks a thread to stop again while it waits: a thread may make room for
# itself in a queue that the stop function empties.
_ASK_EVERY_S = 0.05

_threads: "weakref.WeakKeyDictionary[threading.Thread, Callable[[], None]]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def join_at_exit(thread: threading.Thread, stop: Callable[[], None]):
    """At exit, call ``stop()`` (it must make ``thread`` end soon and may be called again) and join ``thread``.

    Nothing is kept alive by this: a thread that has ended and is no longer
    referenced drops out.
    """
    with _lock:
        _threads[thread] = stop


@atexit.register
def stop_threads():
    """Ask every registered thread that still runs to stop, and join it (at most :data:`EXIT_JOIN_S` in all)."""
    deadline = time.monotonic() + EXIT_JOIN_S
    with _lock:
        pending = [(t, stop) for t, stop in _threads.items() if t.is_alive() and t is not threading.current_thread()]
    for thread, stop in pending:
        while thread.is_alive() and time.monotonic() < deadline:
            try:
                stop()
            except Exception:  # noqa: B902  (exit goes on; the thread is left as it was)
                break
            thread.join(_ASK_EVERY_S)
