"""How a CPU decode on our runners uses the cores: our kernels parallel, torch's ops on one thread.

Why. torch's CPU ops and MKL run their parallel regions on GNU OpenMP, whose
threads spin while they wait at the barrier that ends each region. Where
another process holds one of the cores (a shared machine, a cluster node
running other jobs), one thread of each region is descheduled, the region
waits a scheduler time slice for it, and its spinning partner keeps it from
the core: ``--quantize int8`` on two threads ran 20x slower than on one, and
float32 collapsed as well (issue 50; a decode of the toy makes about 3,000
such regions). The wait policy cannot be changed once torch has loaded
OpenMP, which happens before fairseq loads this plugin.

So on our runners (lean, static, rnn) a decode keeps torch's ops on one thread
(no OpenMP region is ever entered) and gives the threads to our kernels, which
split their products, attentions and output layer through their own loop
(``csrc/cpu/parallel_cpu.cpp``): the calling thread takes chunks too and
never waits for a thread that has not started one, so a call is never
slower than one thread running it alone. Which thread computes a chunk
changes no result: every output element is computed by one thread, in the
same order as on one thread.

The number of threads: ``--cpu-threads N`` (the API's ``cpu_threads``),
else the cores this process may use (``os.sched_getaffinity``), at most
torch's thread count (``OMP_NUM_THREADS``, ``torch.set_num_threads``).
fairseq's runner (the reference) keeps torch's own threads.

Several batches at once: ``--cpu-workers N`` (the API's ``cpu_workers``)
decodes on N forked worker processes, each with its own kernel threads
(:mod:`fairseq_stream.schedule.workers`); :func:`choose_layout` shares the
cores between workers and threads, and the one log line says both.
"""

import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch

from fairseq_stream.errors import FairseqStreamError
from fairseq_stream.ops.loader import compiled_module

logger = logging.getLogger(__name__)

_applied = {"layout": None}


@dataclass(frozen=True)
class ThreadLayout:
    """Worker processes decoding batches at once, threads for our kernels in each (the calling thread
    included) and for torch's ops, and why."""

    kernel_threads: int
    torch_threads: int
    reason: str
    workers: int = 1

    def describe(self) -> str:
        """The layout as the log line gives it."""
        threads = "{} thread{} for our kernels, torch's ops on {} ({})".format(
            self.kernel_threads, "" if self.kernel_threads == 1 else "s", self.torch_threads, self.reason)
        if self.workers == 1:
            return threads
        return "{} workers decoding batches at once, each with {}".format(self.workers, threads)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def check_cpu_threads(value, flag: str = "--cpu-threads") -> Optional[int]:
    """``--cpu-threads`` (or ``flag``): None (choose) or a whole number of at least 1; one-line error otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise FairseqStreamError("{} must be a whole number of at least 1, got {!r}".format(flag, value))
    return value


def choose_layout(cpu_threads: Optional[int] = None, cpu_workers: Optional[int] = None,
                  workers_by_default: bool = False) -> ThreadLayout:
    """The layout for ``--cpu-threads`` and ``--cpu-workers`` (None: chosen from the usable cores).

    The cores: those this process may use, at most torch's thread count.
    ``--cpu-threads`` alone keeps one worker (its meaning before workers
    existed); ``--cpu-workers`` alone shares the cores among the workers;
    neither: one worker a core where ``workers_by_default`` (the workers
    change no bit: each batch decoded on its own, or int8's exact products;
    build.workers_change_no_bit), else one worker with every core for its
    kernels.
    """
    cpu_threads = check_cpu_threads(cpu_threads)
    cpu_workers = check_cpu_threads(cpu_workers, "--cpu-workers")
    cores, why = _cores()
    if cpu_workers is None and cpu_threads is not None:
        return ThreadLayout(cpu_threads, 1, "--cpu-threads {}".format(cpu_threads))
    if cpu_workers is None:
        if workers_by_default and cores > 1:
            return ThreadLayout(1, 1, why, workers=cores)
        return ThreadLayout(cores, 1, why)
    threads = cpu_threads if cpu_threads is not None else max(1, cores // cpu_workers)
    given = "--cpu-workers {}".format(cpu_workers) + (", --cpu-threads {}".format(cpu_threads) if cpu_threads else
                                                       ", {}".format(why))
    if cpu_workers > usable_cores():
        # Honoured (each is a process with its own model copy), but said: 200 workers on 2 cores took 13.2 s
        # of a 37-sentence run that 2 did in 7.5.
        given += "; more workers than the {} usable cores take turns on them".format(usable_cores())
    return ThreadLayout(threads, 1, given, workers=cpu_workers)


def _cores():
    """(cores a decode may use, why that many): the usable cores, at most torch's thread count."""
    cores, torch_threads = usable_cores(), _torch_threads()
    if torch_threads < cores:
        return torch_threads, "torch's thread count {} (OMP_NUM_THREADS or torch.set_num_threads) of the {} " \
            "usable cores".format(torch_threads, cores)
    return cores, "the {} core{} this process may use".format(cores, "" if cores == 1 else "s")


def _torch_threads() -> int:
    # What torch was given before we changed it (a second decoder in the process must not read our 1).
    applied = _applied["layout"]
    return applied[1] if applied is not None else torch.get_num_threads()


def apply_layout(layout: ThreadLayout) -> bool:
    """Set ``layout`` for this process; log it once (again where it changes). False without the kernels."""
    module = compiled_module("cpu")
    if module is None or not hasattr(module, "set_kernel_threads"):
        return False
    before = _applied["layout"]
    original = before[1] if before is not None else torch.get_num_threads()
    module.set_kernel_threads(layout.kernel_threads)
    torch.set_num_threads(layout.torch_threads)
    if before is None or before[0] != layout:
        logger.info("fairseq-stream: CPU threads: %s; --cpu-workers, --cpu-threads to change", layout.describe())
    _applied["layout"] = (layout, original)
    return True


def applied_layout() -> Optional[ThreadLayout]:
    """The layout this process runs (None: none set yet)."""
    applied = _applied["layout"]
    return applied[0] if applied is not None else None


def kernel_threads() -> int:
    """Threads our kernels use now (1 without them)."""
    module = compiled_module("cpu")
    return module.kernel_threads() if module is not None and hasattr(module, "kernel_threads") else 1


def parallel_counters():
    """(kernel calls, calls shared with worker threads, chunks the workers ran) of this process, or None."""
    module = compiled_module("cpu")
    return module.parallel_counters() if module is not None and hasattr(module, "parallel_counters") else None
