"""The start every benchmark script shares: its import paths, and thread pools set before torch starts them.

A script imports it before anything that imports torch (numpy, CTranslate2):
run as ``python benchmarks/NAME.py``, the script's own folder is on
``sys.path``, so this module is found there::

    import preamble  # noqa: F401  (first: before torch)

    preamble.set_threads(1)

Importing it puts the repository (for ``fairseq_stream``) and ``benchmarks/``
(the scripts' shared helpers, which import it too) first on ``sys.path``.
:func:`set_threads` sets the variables that OpenMP, MKL and OpenBLAS read
once, when torch (or numpy, or CTranslate2) starts its thread pool; after
that only ``torch.set_num_threads`` changes torch's own.
"""

import os
import sys

BENCHMARKS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCHMARKS)
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")

for _path in (BENCHMARKS, REPO):  # the repository ends up first
    sys.path.insert(0, _path)


def set_threads(count: int = 1, keep_given: bool = False):
    """Give OpenMP, MKL and OpenBLAS ``count`` threads each (call it before torch is imported).

    ``keep_given``: a variable the caller already set (``OMP_NUM_THREADS=2
    python ...``) keeps its value. The project's figures are single-threaded
    unless a script's ``--threads`` says otherwise, and CTranslate2 (OpenMP)
    or MKL inside torch would otherwise take every core.
    """
    for name in THREAD_VARIABLES:
        if keep_given:
            os.environ.setdefault(name, str(count))
        else:
            os.environ[name] = str(count)
