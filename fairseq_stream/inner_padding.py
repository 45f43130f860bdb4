"""Sources that hold fairseq's padding symbol inside a sentence (a literal ``<pad>`` in the input text).

fairseq's dictionary encodes the word ``<pad>`` as the padding index, and
its collater counts a sentence's length without it. A transformer masks such
a token and numbers positions past it (``make_positions``), so it reads the
sentence as if the token were not there. fairseq's LSTM encoder instead
unpacks its packed sequence to the longest *length*, which is then shorter
than the batch's width: an AssertionError that ends the whole run, at
whichever batch the line falls in (the longest of its batch only).

:func:`without_inner_padding` removes such tokens, as the transformer
effectively does; the glue applies it in front of fairseq's LSTM encoder,
which our rnn runner, fairseq's runner and fairseq's own beam search all
call.
"""

from typing import Tuple

import torch
from torch import Tensor


def without_inner_padding(src_tokens: Tensor, pad: int, left_pad: bool) -> Tuple[Tensor, Tensor]:
    """``src_tokens`` with every padding token moved to the padding side, the batch as wide as its longest
    sentence; and each sentence's length. The same tensor where no sentence holds one (the usual case)."""
    keep = src_tokens.ne(pad)
    lengths = keep.long().sum(dim=1)
    width = int(lengths.max()) if lengths.numel() else 0
    # Without an inner pad, a row's words are one run at its padded side, and the longest fills the batch.
    ordered = keep[:, 1:] >= keep[:, :-1] if left_pad else keep[:, 1:] <= keep[:, :-1]
    if width == src_tokens.size(1) and bool(ordered.all()):
        return src_tokens, lengths
    position = keep.long().cumsum(dim=1) - 1
    if left_pad:
        position += (width - lengths).unsqueeze(1)
    out = src_tokens.new_full((src_tokens.size(0), width), pad)
    rows = torch.arange(src_tokens.size(0), device=src_tokens.device).unsqueeze(1).expand_as(keep)
    out[rows[keep], position[keep]] = src_tokens[keep]
    return out, lengths
