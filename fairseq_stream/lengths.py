"""fairseq's length rules of a search: each sentence's maximum output length, and a bound known on the host.

Functions of the decoder's settings (``max_len_a``, ``max_len_b``,
``min_len``, ``max_len``: the model's positions), which
``BeamDecoder.with_lengths`` changes on a copy.
"""

import logging
import struct
from typing import Tuple

import numpy as np
import torch
from torch import Tensor

from fairseq_stream.errors import FairseqStreamError

logger = logging.getLogger(__name__)


def max_lengths(src_tokens: Tensor, max_len_a: float, max_len_b: int, min_len: int, max_len: int,
                warned: bool) -> Tuple[Tensor, bool]:
    """Each sentence's maximum output length, as fairseq computes it for this batch, and whether the caller has
    now said that the model's positions cap it (``warned``: it had already)."""
    # fairseq bounds the length by the batch's padded source length.
    max_lens = torch.full((src_tokens.size(0),), src_tokens.size(1), dtype=torch.long, device=src_tokens.device)
    max_lens = (max_lens.float() * max_len_a + max_len_b).long()
    capped = int(max_lens.gt(max_len - 1).sum())
    if capped and not warned:
        # fairseq caps silently; say so once, since it can truncate translations.
        logger.warning(
            "fairseq-stream: --max-len-a/-b allow longer outputs than the model's %d "
            "positions; outputs are capped at %d tokens", max_len, max_len - 1)
        warned = True
    max_lens = max_lens.clamp(max=max_len - 1)
    if (max_lens < min_len).any():
        raise FairseqStreamError("--min-len is larger than the maximum length; adjust --max-len-a/-b")
    return max_lens, warned


def longest_max_len(source: int, max_len_a: float, max_len_b: int, max_len: int) -> int:
    """The maximum length :func:`max_lengths` gives a batch whose padded source is ``source`` tokens wide, on
    the host (its float32 arithmetic: ``source * a + b``, truncated, capped by the model's positions)."""
    value = np.float32(source) * np.float32(max_len_a) + np.float32(max_len_b)
    return int(min(max(int(value), 0), max_len - 1))


def shortest_max_len(max_len_a: float, max_len_b: int, max_len: int) -> int:
    """A lower bound on every sentence's maximum length (:func:`max_lengths`), known on the host.

    Below it no sentence can be at its maximum length, and the step skips
    the masking of rows, a pass over the vocabulary. It depends only on the
    length options.
    """
    if not max_len_a >= 0:
        return 0
    try:
        # max_lengths: (width * a + b) in float32, truncated, and width * a >= 0.
        floor = int(struct.unpack("f", struct.pack("f", max_len_b))[0])
    except (OverflowError, ValueError, struct.error):
        return 0
    return min(floor, max_len - 1)
