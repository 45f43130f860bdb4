"""Decoder-step ops with a torch reference and optional compiled backends (``csrc/cpu``, ``csrc/cuda``).

Each op is one Python function that checks its arguments, dispatches to a
backend and holds the torch reference; the compiled kernels live in
``csrc/cpu/<op>_cpu.cpp`` and ``csrc/cuda/<op>_cuda.cu``, built by setup.py into
``fairseq_stream._ops_cpu`` / ``fairseq_stream._ops_cuda`` where possible (the CPU
module's bindings all in ``csrc/cpu/bindings_cpu.cpp``) and loaded by
:mod:`fairseq_stream.ops.loader`.
"""

from fairseq_stream.ops.output_layer import (  # noqa: F401
    OutputLayerResult,
    auto_backend,
    available_backends,
    greedy_log_softmax,
    topk_log_softmax,
)
