"""Rows packed by sentence: each row's place in a ``(sentences, widest beam)`` layout.

Runners that attend over per-sentence encoder tensors pack their rows' queries
this way, so that one batched product per sentence serves all of its rows and
no row needs its own copy of the sentence's keys.

Also :func:`compact`, ``nonzero`` where the host knows the count: both read
nothing back from the device when the caller knows the sizes.
"""

from typing import Optional, Tuple

import torch
from torch import Tensor


def pack_by_sentence(row_sentence: Tensor, sentences: int, width: Optional[int] = None) -> Tuple[Tensor, int]:
    """Each row's index in a ``(sentences, width)`` layout, and ``width`` (the most rows of one sentence).

    Rows of one sentence keep their order; a sentence with fewer rows leaves
    its last places empty. ``width``: the most rows of one sentence where the
    caller knows it (then nothing is read back from the device); None reads it.
    """
    # Counted by index_add: bincount reads the input's range back (on CUDA, even with minlength).
    counts = torch.zeros(sentences, dtype=torch.long, device=row_sentence.device)
    counts.index_add_(0, row_sentence, torch.ones_like(row_sentence))
    order = torch.argsort(row_sentence, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    position = torch.empty_like(row_sentence)
    position[order] = torch.arange(row_sentence.numel(), device=row_sentence.device) - starts[row_sentence[order]]
    if width is None:
        width = max(int(counts.max()), 1) if row_sentence.numel() else 1
    return row_sentence * width + position, width


def compact(mask: Tensor, count: int) -> Tensor:
    """Positions of the ``count`` True entries of ``mask`` (flattened), in order.

    ``mask.nonzero()`` without its host sync: the caller knows ``count``.
    """
    mask = mask.reshape(-1)
    if count == mask.numel():
        return torch.arange(count, device=mask.device)
    # Each True entry goes to its rank among them, the others to a spare slot.
    target = torch.where(mask, torch.cumsum(mask, 0) - 1, count)
    out = torch.empty(count + 1, dtype=torch.long, device=mask.device)
    out.scatter_(0, target, torch.arange(mask.numel(), device=mask.device))
    return out[:count]
