"""A rank started by torchrun dies with torchrun.

torchrun starts each worker in a session of its own, so a launcher killed
with SIGKILL (or by the OOM killer) takes no worker with it: the workers
waited a day for a store that was gone, each holding its memory (and a GPU's).
:func:`die_with_launcher` ties a worker to its launcher: on Linux the kernel
sends it SIGKILL when the launcher exits (``PR_SET_PDEATHSIG``); a worker
whose launcher is already gone when it gets there exits at once; and a
watchdog thread checks the parent every second where ``prctl`` is missing.
"""

import logging
import os
import sys
import threading

from fairseq_stream.parent_death import die_with_parent

logger = logging.getLogger(__name__)

WATCH_EVERY = 1.0  # seconds between the watchdog's checks of the parent


def launched_by_torchrun() -> bool:
    """Whether this process is a worker of torchrun (torch.distributed's elastic agent)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def die_with_launcher():
    """Under torchrun: end this process when the launcher that started it ends; elsewhere nothing.

    Call it as early as possible: a launcher that died before this call has
    left the process with another parent (init or a subreaper); init is
    recognized at once, a subreaper is not, and there the start-up timeout
    of the job's store ends the process instead.
    """
    if not launched_by_torchrun():
        return
    parent = os.getppid()
    if parent == 1 or not die_with_parent(parent):  # init: the launcher is gone already
        _exit_orphaned()
    threading.Thread(target=_watch, args=(parent,), name="bulk-launcher-watchdog", daemon=True).start()


def _watch(parent: int):
    # A thread for systems without prctl; on Linux the signal comes first.
    while True:
        threading.Event().wait(WATCH_EVERY)
        if os.getppid() != parent:
            _exit_orphaned()


def _exit_orphaned():
    sys.stderr.write("fairseq-stream: error: the launcher (torchrun) of this rank has exited; stopping\n")
    sys.stderr.flush()
    os._exit(1)  # now, from any thread: no store, no barrier and no atexit hook may hold the process
