"""Rows packed by sentence: each row's place in a ``(sentences, widest beam)`` layout.

Runners that attend over per-sentence encoder tensors pack their rows' queries
this way, so that one batched product per sentence serves all of its rows and
no row needs its own copy of the sentence's keys.
"""

from typing import Tuple

import torch
from torch import Tensor


def pack_by_sentence(row_sentence: Tensor, sentences: int) -> Tuple[Tensor, int]:
    """Each row's index in a ``(sentences, width)`` layout, and ``width`` (the most rows of one sentence).

    Rows of one sentence keep their order; a sentence with fewer rows leaves
    its last places empty.
    """
    counts = torch.bincount(row_sentence, minlength=sentences)
    order = torch.argsort(row_sentence, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    position = torch.empty_like(row_sentence)
    position[order] = torch.arange(row_sentence.numel(), device=row_sentence.device) - starts[row_sentence[order]]
    width = max(int(counts.max()), 1) if row_sentence.numel() else 1
    return row_sentence * width + position, width
