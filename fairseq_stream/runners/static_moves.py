"""Where a static-slot group's rows go when the search reorders them: slot numbers, and a fixed-size copy list.

The lean runner's rule (:func:`fairseq_stream.runners.lean._move_children`), over a group's
own slots of a shared pool: a row continues its parent's slot if it is the
parent's first child; a later child takes the group's next free slot with a
copy of the parent's keys and values. The copy list is padded to a length
the host knows (rows minus sentences), so nothing is read back and the
shapes do not depend on which rows were chosen.
"""

from typing import List

import torch
from torch import Tensor

from fairseq_stream.ops import attention


def move_children(parent_slot: Tensor, owned: Tensor, pool_slots: int, moved: int):
    """Each new row's slot, and the (source, target) copy list of ``moved`` entries.

    Args:
        parent_slot: (rows,) each new row's parent's slot.
        owned: (capacity >= rows,) the group's slots.
        pool_slots: how many slots the pool has (slot numbers are below it).
        moved: at least the number of later children (rows minus sentences).
    """
    rows, device = parent_slot.numel(), parent_slot.device
    arange = torch.arange(rows, device=device)
    first = torch.full((pool_slots,), rows, dtype=torch.long, device=device)
    first.scatter_reduce_(0, parent_slot, arange, reduce="amin")
    child = first.index_select(0, parent_slot).ne(arange)
    used = torch.zeros(pool_slots, dtype=torch.bool, device=device).index_fill_(0, parent_slot, True)
    free = used.index_select(0, owned).logical_not_()
    capacity = owned.numel()
    # free_slot[r]: the r-th free slot of the group (entries past them are never read).
    free_slot = torch.zeros(capacity + 1, dtype=torch.long, device=device).scatter_(
        0, torch.where(free, torch.cumsum(free, 0) - 1, capacity), owned)
    child_rank = torch.cumsum(child, 0) - 1
    new_slot = torch.where(child, free_slot.index_select(0, child_rank.clamp(min=0)), parent_slot)
    # Entry r copies the r-th child's parent slot to its new slot; the entries past the children copy row 0's
    # slot onto itself (row 0 is never a child).
    at = torch.where(child, child_rank, moved)
    source = parent_slot[:1].repeat(moved + 1).scatter_(0, at, parent_slot)[:moved]
    target = parent_slot[:1].repeat(moved + 1).scatter_(0, at, new_slot)[:moved]
    return new_slot, source, target


def copy_slots(caches: List[Tensor], source: Tensor, target: Tensor, positions: int, compiled: bool = True):
    """Positions ``0..positions-1`` of each ``source`` slot copied to its ``target`` slot, in every model's cache.

    ``compiled``: :func:`fairseq_stream.ops.attention.copy_slots_` (the
    compiled copy for the caches' device where it is built); False: torch's
    indexed copy (what a trace of the CUDA step saw before CUDA had a kernel).
    """
    if positions and source.numel():
        for cache in caches:
            if compiled:
                attention.copy_slots_(cache, source, target, positions)
            else:
                attention.indexed_copy_slots_(cache, source, target, positions)


def ordered_distinct(values: List[int]) -> List[int]:
    """``values`` without repeats, in order of first appearance."""
    return list(dict.fromkeys(values))
