"""Ctrl-C in the command-line tools: one line and exit status 130, never a traceback from inside fairseq.

A KeyboardInterrupt raised wherever SIGINT lands (inside our decode, in
fairseq-generate's printing between two batches, in fairseq's data loader)
would end fairseq-generate with fairseq's traceback and status -2. The
handler here, installed when our generator is built for a fairseq tool,
prints one line and raises ``SystemExit(130)``, as the bulk tool ends: ``finally`` blocks still
run on the way out (the encoder thread is stopped, exit joins the threads
left: :mod:`fairseq_stream.exit_threads`). The CPU workers put their own
handler in its place while they run (it stops them first) and put it back.

Only in a fairseq tool's process, and only from its main thread: a program
that builds a generator itself (the Python API, ``task.build_generator`` in
a notebook, the tests) keeps its own Ctrl-C.
"""

import os
import signal
import sys

INTERRUPTED = "fairseq-stream: interrupted"


def in_fairseq_tool() -> bool:
    """Whether this process is one of fairseq's command-line tools (``fairseq-generate``, ``python -m
    fairseq_cli.interactive``, our ``fairseq-stream-generate``), not a program that builds a generator."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    script = os.path.basename(getattr(main, "__file__", None) or "")
    return script.startswith("fairseq-") or getattr(spec, "name", "").startswith("fairseq_cli.")


def exit_on_ctrl_c() -> bool:
    """Install the one-line handler for SIGINT (once) in a fairseq tool's main thread; whether it is installed."""
    if getattr(signal.getsignal(signal.SIGINT), "_fairseq_stream", False):
        return True
    if not in_fairseq_tool():
        return False
    try:
        signal.signal(signal.SIGINT, _interrupted)
    except ValueError:  # not the main thread
        return False
    return True


def _interrupted(signum, frame):
    print(INTERRUPTED, file=sys.stderr, flush=True)
    sys.exit(130)


_interrupted._fairseq_stream = True
