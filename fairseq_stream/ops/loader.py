"""The loader of the compiled kernels: ``fairseq_stream._ops_cpu`` and ``_ops_cuda``, once a process.

Every op of this package reaches its kernels through :func:`compiled_module`;
the fused output layer (``output_layer.py``) is one of them, not their loader.
A module that is not built, was built for another torch, or was built for CPU
extensions this CPU lacks is a miss: the ops then run on torch, and the
process logs once why and what that costs.
"""

import importlib
import importlib.util
import logging
from typing import Optional

import torch

from fairseq_stream import cpu_info

# Compiled modules, loaded on first use: name -> module or None, and why not.
_EXTENSIONS = {}
_MISSING = {}


def compiled_module(kind: str):
    """The compiled module for ``kind`` ("cpu" or "cuda"), or None if it is not built.

    Loaded once and cached (a miss too, with its reason for :func:`missing_reason`);
    every op of this package reaches its kernels through it.
    """
    if kind not in _EXTENSIONS:
        try:
            _EXTENSIONS[kind] = _load("fairseq_stream._ops_" + kind)
        except ImportError as e:  # not built (optional), or built for another torch
            _EXTENSIONS[kind] = None
            _MISSING[kind] = str(e)
            if kind == "cpu" or torch.cuda.is_available():  # once a process: what is slow, and the cure
                logging.getLogger(__name__).warning(
                    "fairseq-stream: the compiled %s kernels (fairseq_stream._ops_%s) are not built or do not "
                    "load (%s): the search step, the lean runner's layers and the fused output layer run on "
                    "slower torch ops; build them with `pip install --no-build-isolation -e .` after torch "
                    "(README: Install)", kind.upper(), kind, e)
    return _EXTENSIONS[kind]


def _load(name: str):
    """Import the compiled module ``name``, unless it was built for CPU extensions this CPU lacks (ImportError).

    A build for an AVX-512 machine (FAIRSEQ_STREAM_MARCH=native) moved to an
    AVX2-only one, or the x86-64-v3 baseline on a CPU without AVX2, would die
    with an illegal instruction while loading; refused, it runs on torch ops
    and the caller logs why, in one line.
    """
    path = _library_path(name)
    missing = cpu_info.missing_extensions(cpu_info.build_needs(path) or ()) if path else []
    if missing:
        raise ImportError("{} was built for CPU extensions this CPU ({}) lacks: {}; rebuild it: with "
                          "FAIRSEQ_STREAM_MARCH unset for every AVX2 machine, =native for this one".format(
                              path, cpu_info.cpu_model(), " ".join(missing)))
    return importlib.import_module(name)


def _library_path(name: str) -> Optional[str]:
    """The file the import of ``name`` would load, found without loading it; None where there is none."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):  # the import itself then raises what is wrong
        return None
    return spec.origin if spec is not None else None


def missing_reason(kind: str) -> str:
    """Why the compiled module for ``kind`` is not loaded ("" where it is)."""
    if compiled_module(kind) is not None:
        return ""
    return _MISSING.get(kind, "not found")
