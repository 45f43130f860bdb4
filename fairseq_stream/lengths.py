"""fairseq's length rules of a search: each sentence's maximum output length, and a bound known on the host.

Functions of the decoder's settings (``max_len_a``, ``max_len_b``,
``min_len``, ``max_len``: the model's positions), which
``BeamDecoder.with_lengths`` changes on a copy.
"""

import logging
import math
import sys
from typing import Tuple

import torch
from torch import Tensor

from fairseq_stream.errors import MIN_LEN_ABOVE_MAX, FairseqStreamError

logger = logging.getLogger(__name__)


def max_lengths(src_tokens: Tensor, max_len_a: float, max_len_b: int, min_len: int, max_len: int,
                warned: bool) -> Tuple[Tensor, bool]:
    """Each sentence's maximum output length, as fairseq computes it for this batch, and whether the caller has
    now said that the model's positions cap it (``warned``: it had already)."""
    # fairseq bounds the length by the batch's padded source length, one bound for the whole batch.
    longest = batch_max_len(src_tokens.size(1), max_len_a, max_len_b)
    max_lens = torch.full((src_tokens.size(0),), longest, dtype=torch.long, device=src_tokens.device)
    capped = int(max_lens.gt(max_len - 1).sum())
    if capped and not warned:
        # fairseq caps silently; say so once, since it can truncate translations.
        logger.warning(
            "fairseq-stream: --max-len-a/-b allow longer outputs than the model's %d "
            "positions; outputs are capped at %d tokens", max_len, max_len - 1)
        warned = True
    max_lens = max_lens.clamp(max=max_len - 1)
    if (max_lens < min_len).any():
        raise FairseqStreamError(MIN_LEN_ABOVE_MAX)
    return max_lens, warned


def batch_max_len(width: int, max_len_a: float, max_len_b: int) -> int:
    """fairseq's ``int(max_len_a * src_len + max_len_b)`` for a batch whose padded source is ``width`` tokens
    wide, in Python's double arithmetic as fairseq computes it (``sequence_generator.py``), before the cap
    by the model's positions.

    In float32 the product rounds otherwise: ``1.16 * 25`` is 28.999999999999996
    in double and 29.0 in float32, maximum lengths of 28 and 29.
    """
    value = max_len_a * width + max_len_b
    if not math.isfinite(value):
        return 0 if value != value or value < 0 else sys.maxsize  # nan, -inf: no length; +inf: the cap
    return int(value)


def longest_max_len(source: int, max_len_a: float, max_len_b: int, max_len: int) -> int:
    """The maximum length :func:`max_lengths` gives a batch whose padded source is ``source`` tokens wide, on
    the host (:func:`batch_max_len`, capped by the model's positions)."""
    return int(min(max(batch_max_len(source, max_len_a, max_len_b), 0), max_len - 1))


def shortest_max_len(max_len_a: float, max_len_b: int, max_len: int) -> int:
    """A lower bound on every sentence's maximum length (:func:`max_lengths`), known on the host.

    Below it no sentence can be at its maximum length, and the step skips
    the masking of rows, a pass over the vocabulary. It depends only on the
    length options.
    """
    if not max_len_a >= 0:
        return 0
    # max_lengths: int(width * a + b), and width * a >= 0: at least b's whole part.
    floor = batch_max_len(0, 0.0, max_len_b)
    return max(min(floor, max_len - 1), 0)
