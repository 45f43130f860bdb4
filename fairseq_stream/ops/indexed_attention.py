"""One query a row over cached keys and values the row names by index, in place: the static step's CUDA attention.

The static-slot runner keeps every key and value in a pool of slots and gives
each row the slot it reads (its key/value slot for self-attention, its
sentence slot for the encoder's keys). Its torch form
(:mod:`fairseq_stream.runners.static_attention`) gathers each row's keys and
values into new tensors every layer and step; at the WMT'19 size with 4
members stacked that moved about 7.7 GB a decoder call where the lean runner
moves 0.2 GB (``benchmarks/device_work.py``, docs/GPU.md). The CUDA kernel
here (``csrc/cuda/indexed_attention_cuda.cu``: a block per row and head,
the positions in chunks with a running softmax) reads them where they lie.

Arithmetic: float accumulation (double for float64) in another order than
torch's bmm and softmax, so the results equal :func:`reference`'s to rounding
(tests/test_indexed_attention.py, through the CUDA emulation); a row is
computed on its own, whatever rows run beside it (padding to a bucket changes
no bit of the others).
"""

import math
from typing import Optional

import torch
from torch import Tensor

from fairseq_stream.ops.loader import compiled_module

# The kernel's largest head_dim (csrc/cuda/indexed_attention_cuda.h: a thread per output dimension).
MAX_HEAD_DIM = 256
_TYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _cuda_extension():
    module = compiled_module("cuda")
    return module if hasattr(module, "indexed_attention") else None


def available(q: Tensor, keys: Tensor) -> bool:
    """Whether the CUDA kernel runs for queries ``q`` over ``keys`` (CUDA, a floating type, contiguous keys,
    head_dim at most :data:`MAX_HEAD_DIM`, the module built)."""
    return (q.is_cuda and q.dtype in _TYPES and keys.size(3) <= MAX_HEAD_DIM and keys.dtype == q.dtype
            and keys.is_contiguous() and _cuda_extension() is not None)


def indexed_attention(q: Tensor, keys: Tensor, values: Tensor, index: Tensor, mask: Optional[Tensor] = None,
                      lengths: Optional[Tensor] = None, scale: float = 1.0) -> Tensor:
    """Row ``r``'s query over ``keys[index[r]]`` and ``values[index[r]]``, on CUDA (:func:`available`).

    Args:
        q: (rows, heads * head_dim).
        keys, values: (slots, heads, T, head_dim), contiguous.
        index: (rows,) int64, each row's slot.
        mask: additive, (slots, T) or (slots, 1, 1, T), or None.
        lengths: (rows,) int64: row ``r`` attends over positions ``0..lengths[r]`` only; None: all ``T``.
        scale: the scores' factor.

    Returns:
        (rows, heads * head_dim) in q's dtype; NaN for a row with no visible position, as torch's softmax.
    """
    q = q if q.stride(-1) == 1 else q.contiguous()
    if mask is not None and mask.dtype != q.dtype:
        mask = mask.to(q.dtype)
    return _cuda_extension().indexed_attention(q, keys, values, index, mask, lengths, float(scale))


def reference(q: Tensor, keys: Tensor, values: Tensor, index: Tensor, mask: Optional[Tensor] = None,
              lengths: Optional[Tensor] = None, scale: float = 1.0) -> Tensor:
    """:func:`indexed_attention` in torch (the static step's torch form: gather, mask, softmax), on any device."""
    rows, (slots, H, T, hd) = q.size(0), keys.shape
    query = q.reshape(rows, H, 1, hd)
    k, v = keys.index_select(0, index), values.index_select(0, index)
    weights = torch.matmul(query * scale, k.transpose(2, 3))  # (rows, H, 1, T)
    if mask is not None:
        weights = weights + mask.reshape(slots, T).index_select(0, index).view(rows, 1, 1, T)
    if lengths is not None:
        hidden = torch.arange(T, device=q.device).view(1, T) > lengths.view(rows, 1)
        weights = weights.masked_fill(hidden.view(rows, 1, 1, T), -math.inf)
    return torch.matmul(torch.softmax(weights, dim=-1), v).reshape(rows, H * hd)
