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
    """In a child of process ``parent``: ask for SIGKILL when it exits (where the kernel offers that). False
    where the parent is gone already, before or while the signal was armed: the caller exits then."""
    if os.getppid() != parent:
        return False
    set_parent_death_signal()
    return os.getppid() == parent  # else the parent died between the two looks: no signal will come
