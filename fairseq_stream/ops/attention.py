"""The lean runner's two attentions of a decoder step (one query per row), compiled on the CPU.

* :func:`cached_attention_`: self-attention. Writes each row's key and value
  at position ``length`` of its cache slot, then attends over positions
  ``0..length`` of that slot.
* :func:`source_attention`: encoder attention. Each row attends over its
  sentence's encoder keys and values (``row_sentence``), padding masked.

In torch each is a handful of ops whose fixed cost dominates at decoder-step
sizes (a cache write by index; batched matmuls of one query by a few dozen
keys per row and head; a softmax; for the encoder attention, packing the rows
by sentence and back). The compiled versions
(``csrc/cpu/attention_cpu.cpp``) run each (row, head) as one short loop over
its own keys, in float32 or float64. The torch references below are what runs
elsewhere (CUDA, no extension) and what the tests compare against.

**Arithmetic.** The compiled kernels sum in another order than torch's, and
float32's exp is the Cephes approximation (within 1 ulp), so results differ
from the references by rounding: within 1e-5 in float32 and 1e-12 in float64
(tests/test_attention.py). Each row is computed on its own.
"""

import math
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from fairseq_stream.ops.loader import compiled_module
from fairseq_stream.ops.packing import pack_by_sentence

# Below this many rows torch's fused attention is faster than two bmm calls
# on one CPU thread (measured: 0.02 against 0.04 ms at 5 rows); above it,
# about half as fast (2.5 against 1.2 ms at 320 rows).
BMM_ATTENTION_ROWS = 16


def _use_sdpa(t: Tensor, rows: int) -> bool:
    """Whether torch's fused ``scaled_dot_product_attention`` runs for ``rows`` rows of ``t``'s device.

    The CPU only. On CUDA, torch 2.11 may hand a half-precision call to its
    cuDNN backend, which builds an execution plan for every new shape, and a
    decoder's shapes change at every step (the prefix grows, sentences end):
    the lean runner spent 40 ms a call in fp16 on an H100 against 5 ms in
    fp32, and a second pass over the same shapes ran at fp32's speed
    (docs/GPU.md, 2026-11-27). The bmm formulation builds nothing. Its
    global switch (``torch.backends.cuda.enable_cudnn_sdp``) is not used:
    fairseq's encoder, maybe in another thread, reads it too.
    """
    return t.is_cpu and rows < BMM_ATTENTION_ROWS


def _extension():
    """The CPU module where it is built with these kernels; None: the torch references run instead."""
    module = compiled_module("cpu")
    return module if hasattr(module, "cached_attention_") else None


def compiled_applies(q: Tensor) -> bool:
    """Whether the compiled kernels run for queries ``q`` (CPU, float32 or float64, extension built)."""
    return q.is_cpu and q.dtype in (torch.float32, torch.float64) and _extension() is not None


def write_rows_(k: Tensor, v: Tensor, keys: Tensor, values: Tensor, slot: Optional[Tensor], position):
    """Row ``r``'s key and value (``k``, ``v``: (rows, heads * head_dim)) written into ``keys`` and ``values``
    (slots, heads, capacity, head_dim) at slot ``slot[r]`` (None: slot ``r``) and ``position`` (an int, or a
    (rows,) tensor of each row's): the torch forms' cache write."""
    n, H, hd = k.size(0), keys.size(1), keys.size(3)
    rows = slice(0, n) if slot is None else slot
    keys[rows, :, position] = k.reshape(n, H, hd)
    values[rows, :, position] = v.reshape(n, H, hd)


def cached_attention_(q: Tensor, k: Tensor, v: Tensor, keys: Tensor, values: Tensor, slot: Optional[Tensor],
                      length: int, scale: float, compiled: bool = True) -> Tensor:
    """Write ``k``, ``v`` at ``length`` of each row's cache slot, then attend over positions ``0..length``.

    Args:
        q, k, v: (rows, heads * head_dim); rows may be strided (views of a
            fused projection).
        keys, values: (slots, heads, capacity, head_dim), contiguous; written
            in place.
        slot: (rows,) each row's slot, or None: row i is slot i.
        compiled: False for the torch reference.

    Returns:
        (rows, heads * head_dim).
    """
    if compiled and compiled_applies(q):
        return _extension().cached_attention_(q, k, v, keys, values, slot, length, scale)
    n = q.size(0)
    write_rows_(k, v, keys, values, slot, length)
    if slot is None:
        return attend_prefix(q, keys[:n], values[:n], length + 1, scale)
    # Attend in slot order (free slots included, their output dropped)
    # rather than gathering every row's keys.
    query = q.new_zeros(keys.size(0), q.size(1)).index_copy_(0, slot, q)
    return attend_prefix(query, keys, values, length + 1, scale).index_select(0, slot)


def window_attention_(q: Tensor, k: Tensor, v: Tensor, keys: Tensor, values: Tensor, window_row: Tensor,
                      window_step: Tensor, needed: int, scale: float, compiled: bool = True,
                      visible: Optional[Tensor] = None) -> Tensor:
    """Jacobi's window: write every window position's key and value, then attend causally inside the window.

    Window position n is a query of cache row ``window_row[n]`` at position
    ``window_step[n]``; it attends over that row's positions ``0 ..
    window_step[n]``. A row's window may be any width (one position where it
    has no draft), so the layout is flat rather than (rows, W).

    Args:
        q, k, v: (positions, heads * head_dim); rows may be strided.
        keys, values: (rows, heads, capacity, head_dim), contiguous; written in place.
        window_row, window_step: (positions,) int64.
        needed: ``max(window_step) + 1``, known to the caller without a device read
            (the reference's key length; the compiled kernel does not need it).
        compiled: False for the torch reference.
        visible: (positions, W >= needed) additive (0 or -inf), or None: a
            tree-shaped window, where a position attends over its row's
            positions up to its own that this mask leaves visible (the
            verified prefix and its ancestors in the tree).

    Returns:
        (positions, heads * head_dim).
    """
    if compiled and compiled_applies(q):
        return _extension().window_attention_(q, k, v, keys, values, window_row, window_step, scale, visible)
    N, H, hd = window_row.numel(), keys.size(1), keys.size(3)
    write_rows_(k, v, keys, values, window_row, window_step)
    causal = torch.arange(needed, device=q.device).view(1, needed) <= window_step.view(N, 1)
    if visible is not None:
        causal = causal & visible[:, :needed].eq(0)
    visible = causal.view(N, 1, 1, needed)
    query = q.reshape(N, H, 1, hd)
    k_rows = keys.index_select(0, window_row)[:, :, :needed]
    v_rows = values.index_select(0, window_row)[:, :, :needed]
    if _use_sdpa(q, 0):  # 0: at any size on the CPU (no bmm form measured there for the window)
        out = F.scaled_dot_product_attention(query, k_rows, v_rows, attn_mask=visible, scale=scale)
    else:
        weights = torch.matmul(query * scale, k_rows.transpose(2, 3)).masked_fill_(~visible, -math.inf)
        out = torch.matmul(torch.softmax(weights, dim=-1), v_rows)
    return out.reshape(N, H * hd)


def source_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Optional[Tensor], scale: float,
                     row_sentence: Tensor, packing: Optional[Tuple[Tensor, int]] = None,
                     compiled: bool = True) -> Tensor:
    """Each row's query over its sentence's encoder keys and values.

    Args:
        q: (rows, heads * head_dim); rows may be strided.
        keys, values: (sentences, heads, source, head_dim), contiguous.
        mask: (sentences, 1, 1, source) additive (0 or -inf), or None.
        row_sentence: (rows,) each row's sentence.
        packing: :func:`pack_by_sentence` of ``row_sentence``, if the caller
            keeps it (the reference needs it; the compiled kernel does not).
        compiled: False for the torch reference.

    Returns:
        (rows, heads * head_dim).
    """
    if compiled and compiled_applies(q):
        return _extension().source_attention(q, keys, values, row_sentence, mask, scale)
    S, H, _, hd = keys.shape
    where, width = packing if packing is not None else pack_by_sentence(row_sentence, S)
    packed = q.new_zeros(S * width, q.size(1))
    packed[where] = q
    out = attend_packed_source(packed.view(S, width, H, hd), keys, values, mask, scale)
    return out.reshape(S * width, q.size(1))[where]


def attend_prefix(q: Tensor, keys: Tensor, values: Tensor, length: int, scale: float) -> Tensor:
    """Torch: one query per row over the first ``length`` cached positions.

    Args:
        q: (rows, heads * head_dim).
        keys, values: (rows, heads, capacity, head_dim), contiguous.

    Returns:
        (rows, heads * head_dim).
    """
    rows, heads, capacity, head_dim = keys.shape
    if _use_sdpa(q, rows):
        return F.scaled_dot_product_attention(
            q.reshape(rows, heads, 1, head_dim), keys[:, :, :length], values[:, :, :length],
            scale=scale).view(rows, -1)
    # (rows * heads) batches of one query; the cache slices stay views.
    k = keys.view(rows * heads, capacity, head_dim)[:, :length]
    v = values.view(rows * heads, capacity, head_dim)[:, :length]
    weights = torch.bmm(q.reshape(rows * heads, 1, head_dim) * scale, k.transpose(1, 2))
    return torch.bmm(torch.softmax(weights, dim=-1), v).view(rows, -1)


def attend_packed_source(q: Tensor, keys: Tensor, values: Tensor, mask: Optional[Tensor], scale: float) -> Tensor:
    """Torch: queries packed by sentence over each sentence's encoder keys.

    Args:
        q: (sentences, width, heads, head_dim).
        keys, values: (sentences, heads, source, head_dim).
        mask: (sentences, 1, 1, source) additive, or None.

    Returns:
        (sentences, width, heads, head_dim).
    """
    S, W, H, hd = q.shape
    T = keys.size(2)
    if _use_sdpa(q, S * W):
        return F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask,
                                              scale=scale).transpose(1, 2)
    query = q.transpose(1, 2).reshape(S * H, W, hd) * scale
    weights = torch.bmm(query, keys.view(S * H, T, hd).transpose(1, 2))
    if mask is not None:
        weights = (weights.view(S, H, W, T) + mask).view(S * H, W, T)
    out = torch.bmm(torch.softmax(weights, dim=-1), values.view(S * H, T, hd))
    return out.view(S, H, W, hd).transpose(1, 2)


def _slot_copier(cache: Tensor):
    """The compiled module whose ``copy_cache_slots_`` copies within ``cache`` (the CPU's or CUDA's, for a
    contiguous cache where it is built), else None."""
    if not cache.is_contiguous() or cache.device.type not in ("cpu", "cuda"):
        return None
    module = _extension() if cache.is_cpu else compiled_module("cuda")
    return module if hasattr(module, "copy_cache_slots_") else None


def copies_slots_in_place(cache: Tensor) -> bool:
    """Whether :func:`copy_slots_` runs a compiled copy for ``cache`` (each position read and written once,
    padded entries skipped), not torch's indexed assignment (a gather, then a scatter, of every entry)."""
    return _slot_copier(cache) is not None


def copy_slots_(cache: Tensor, source: Tensor, target: Tensor, length: int):
    """Positions ``0..length-1`` of each ``source`` slot of ``cache`` copied to its ``target`` slot, in place.

    ``cache``: (2 * layers, slots, heads, capacity, head_dim); targets are
    slots no source is; an entry whose source is its target (the padding of
    a copy list of fixed length) copies nothing. On the CPU one compiled
    pass of plain copies (about a tenth of a beam step's time went to
    torch's indexed assignment at k=5 and 64 sentences); on CUDA a kernel
    (``csrc/cuda/cache_slots_cuda.cu``: torch's form moved each byte twice
    and copied the padded entries too); elsewhere torch's. Bits are copied:
    every form gives the same cache.
    """
    copier = _slot_copier(cache)
    if copier is not None:
        copier.copy_cache_slots_(cache, source, target, int(length))
    else:
        indexed_copy_slots_(cache, source, target, length)


def indexed_copy_slots_(cache: Tensor, source: Tensor, target: Tensor, length: int):
    """:func:`copy_slots_` by torch's indexed assignment (a gather of every entry, then a scatter), on any
    device: the form without a compiled copy, and the one whose ATen shapes a trace of the step compares."""
    cache[:, target, :, :length] = cache[:, source, :, :length]



def follow_parents_(caches: List[Tensor], parent_slot: Tensor, length: int, compact_above: int,
                    compiled: bool = True) -> Tuple[List[Tensor], Tensor]:
    """Move the self-attention caches to the next beam: ``(caches, each row's slot)``.

    Row ``r`` continues the row in slot ``parent_slot[r]`` (rows no more than
    the caches' slots): it keeps that slot, except a parent's second and
    later children, which take the free slots, lowest first, with a copy of
    positions ``0..length-1`` (:func:`copy_slots_`). Then, where at least
    ``2 * compact_above`` slots are more than twice the rows (sentences
    ended), the caches are gathered to the rows' slots and every row is its
    own slot. ``caches`` are written in place; the list returned holds new
    tensors where compacted.

    On the CPU (``compiled``, contiguous caches) the compiled loop's own
    function runs (``csrc/cpu/cache_slots_cpu.cpp``), so the lean runner's
    reorder and the compiled search loop place rows by one implementation;
    elsewhere the torch form below, with the same slots.
    """
    module = _extension()
    if compiled and module is not None and hasattr(module, "reorder_cache_slots_") and \
            all(c.is_cpu and c.is_contiguous() for c in caches):
        caches, slot = module.reorder_cache_slots_(caches, parent_slot, int(length), int(compact_above))
        return list(caches), slot
    rows, capacity = parent_slot.numel(), caches[0].size(1)
    arange = torch.arange(rows, device=parent_slot.device)
    slot = parent_slot
    # A row keeps its parent's slot; a parent's second and later children get free slots with a copy of its
    # keys and values.
    first = torch.full((capacity,), rows, dtype=torch.long, device=slot.device)
    first.scatter_reduce_(0, slot, arange, reduce="amin")
    children = (first.index_select(0, slot) != arange).nonzero().flatten()
    if children.numel():
        used = torch.zeros(capacity, dtype=torch.bool, device=slot.device)
        used[slot] = True
        target = (~used).nonzero().flatten()[: children.numel()]
        if length:
            source = slot.index_select(0, children)
            for cache in caches:
                copy_slots_(cache, source, target, length)
        slot = slot.index_put((children,), target)
    if capacity >= 2 * compact_above and 2 * rows < capacity:
        # Most slots are free (sentences ended): attention runs over every slot, so gather the used ones.
        caches = [c.index_select(1, slot) for c in caches]
        slot = arange
    return caches, slot
