"""A child process that ends when its parent does: torchrun's ranks, the CPU workers.

A parent killed with SIGKILL or SIGTERM (or by the OOM killer) runs no
cleanup, so children it forked or launched kept running under init, each
holding its memory (and a GPU's). On Linux the kernel can send a child
SIGKILL when its parent exits (``prctl(PR_SET_PDEATHSIG)``), armed by the
child itself; a parent that died before the child armed it is seen by the
child's parent id having changed.
"""

import ctypes
import ctypes.util
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def set_parent_death_signal() -> bool:
    """Ask the kernel for SIGKILL when this process's parent exits (Linux); False where that is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(parent: int) -> bool:
    """In a child of process ``parent``: SIGKILL when it exits. False where the parent is gone already (the
    caller exits then) or the signal is not available."""
    if os.getppid() != parent:
        return False
    armed = set_parent_death_signal()
    return armed and os.getppid() == parent  # the parent died between the two looks: no signal will come
