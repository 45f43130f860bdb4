"""Keep freed memory in the process while our runners decode on the CPU (glibc's ``mallopt``).

A decoder's big buffers live for a batch: the self-attention caches (63 MB
for a batch of 64 at beam 5 on the Multi30k transformer, about 0.5 GB for a
WMT'19 transformer-big), the logits of a step. glibc serves a block above its
mmap threshold (at most 32 MB) with fresh pages from the kernel and hands
them back when it is freed, so every batch faulted its caches in again, page
by page: 320,000 page faults in a decode of Multi30k's test set at beam 5,
about a tenth of its time on one Xeon thread (docs/quantize.md). PyTorch's
CPU tuning guide gives the same advice for the same reason (an allocator
that keeps freed memory: jemalloc with decay off, or TCMalloc, preloaded);
a plugin cannot preload an allocator into ``fairseq-generate``, but it can
ask glibc to keep what is freed: no mmap for big blocks, no trimming of the
heap. The process then keeps its peak memory until it exits, as a caching
allocator does.

``FAIRSEQ_STREAM_SYSTEM_MALLOC=1`` leaves glibc's defaults alone. Other C
libraries (musl, macOS) are left alone too.
"""

import ctypes
import ctypes.util
import logging
import os
import platform

logger = logging.getLogger(__name__)

# glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
NEVER_TRIM = 2 ** 31 - 1  # mallopt takes an int

OPT_OUT = "FAIRSEQ_STREAM_SYSTEM_MALLOC"
_applied = None


def opted_out() -> bool:
    """Whether ``FAIRSEQ_STREAM_SYSTEM_MALLOC`` asks to keep the C library's defaults."""
    return os.environ.get(OPT_OUT, "").strip().lower() not in ("", "0", "false", "no")


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed memory for reuse (once per process); whether it now does.

    False where the C library is not glibc, where ``mallopt`` refuses, or
    where ``FAIRSEQ_STREAM_SYSTEM_MALLOC`` is set.
    """
    global _applied
    if _applied is None:
        _applied = _apply()
        if _applied:
            logger.info("fairseq-stream: keeping freed memory in the process for reuse (glibc mallopt: no mmap, "
                        "no trim), so that each batch's caches reuse pages; %s=1 to leave malloc alone", OPT_OUT)
    return _applied


def _apply() -> bool:
    if opted_out() or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    # mallopt returns 1 on success.
    return libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TRIM_THRESHOLD, NEVER_TRIM) == 1
