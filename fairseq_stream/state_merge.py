"""Joining the decoder state of groups of rows that were encoded separately.

The streaming scheduler decodes sentences admitted at different times in one
decoder call once their target prefixes have the same length. Their encoder
outputs then have different source lengths (each fairseq batch is padded to
its own longest source), so joining pads the source axis on the right with
masked positions: cross-attention has no notion of position, so a masked
key is exactly absent (its softmax weight is 0). Padding goes on the right so
that the real keys keep their index, which keeps the floating-point reduction
order of the attention sums as close as possible to the unjoined case.

Only state layouts we know are joined: fairseq's transformer encoder output
(a dict) and LSTM encoder output (a 4-tuple), ``MultiheadAttention`` buffers
and the LSTM decoder's ``cached_state``. Anything else is refused with an
error naming ``--generator batch``, never guessed.
"""

from typing import Dict, List, Optional

import torch
from torch import Tensor

from fairseq_stream.errors import FairseqStreamError

UNSUPPORTED = (
    "--generator stream cannot join the decoder state of {} (known: fairseq transformer "
    "and LSTM models); use --generator batch"
)


def source_length(encoder_out) -> int:
    """Length of the source axis of one model's encoder output."""
    if isinstance(encoder_out, dict):
        return encoder_out["encoder_out"][0].size(0)
    if isinstance(encoder_out, tuple) and len(encoder_out) == 4:
        return encoder_out[0].size(0)
    raise FairseqStreamError(UNSUPPORTED.format("encoder output " + type(encoder_out).__name__))


def _pad(t: Tensor, dim: int, length: int, value) -> Tensor:
    extra = length - t.size(dim)
    if extra <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t, t.new_full(shape, value)], dim=dim)


def concat_encoder_outs(parts: List, length: int):
    """Concatenate one model's encoder outputs along the batch, padding sources to ``length``."""
    first = parts[0]
    if isinstance(first, dict):
        out = {}
        for key, (time_dim, batch_dim, fill) in _TRANSFORMER_ENCODER_KEYS.items():
            lists = [p[key] for p in parts]
            if any(len(x) == 0 for x in lists):
                out[key] = []
                continue
            out[key] = [
                torch.cat([_pad(x[0], time_dim, length, fill) if time_dim is not None else x[0]
                           for x in lists], dim=batch_dim)
            ]
        states = [p["encoder_states"] for p in parts]
        out["encoder_states"] = [
            torch.cat([_pad(s[i], 0, length, 0.0) for s in states], dim=1)
            for i in range(min(len(s) for s in states))
        ]
        return out
    if isinstance(first, tuple) and len(first) == 4:
        outs = torch.cat([_pad(p[0], 0, length, 0.0) for p in parts], dim=1)
        hiddens = torch.cat([p[1] for p in parts], dim=1)
        cells = torch.cat([p[2] for p in parts], dim=1)
        mask = torch.cat([_pad(p[3], 0, length, True) for p in parts], dim=1)
        return (outs, hiddens, cells, mask)
    raise FairseqStreamError(UNSUPPORTED.format("encoder output " + type(first).__name__))


# key -> (source axis or None, batch axis, padding value)
_TRANSFORMER_ENCODER_KEYS = {
    "encoder_out": (0, 1, 0.0),
    "encoder_padding_mask": (1, 0, True),
    "encoder_embedding": (1, 0, 0.0),
    "src_tokens": (1, 0, 1),
    "src_lengths": (None, 0, 0),
}


def state_owners(decoder) -> Dict[str, object]:
    """Map each incremental-state id under ``decoder`` to the module owning it."""
    return {
        m._incremental_state_id: m
        for m in decoder.modules()
        if getattr(m, "_incremental_state_id", None) is not None
    }


def concat_incremental_states(owners: Dict[str, object], states: List[dict], rows: List[int],
                              source_len: int, mixed_lengths: bool = False) -> dict:
    """Concatenate one model's incremental states (one dict per group of rows).

    With ``mixed_lengths`` the groups' prefixes may differ in length (one
    VAR-STR-FIFO call): self-attention caches are padded on the right to the
    longest and the padding is masked (``prev_key_padding_mask``); fairseq's
    attention then appends the new key after the padding. Use
    :func:`take_new_step` after the call to give each group its own state back.
    """
    from fairseq.modules.multihead_attention import MultiheadAttention

    keys = set().union(*(s.keys() for s in states))
    out = {}
    for full_key in keys:
        owner_id, _, name = full_key.partition(".")
        owner = owners.get(owner_id)
        buffers = [s.get(full_key) for s in states]
        if any(b is None for b in buffers):
            raise FairseqStreamError("internal: joining decoder states of different steps")
        if isinstance(owner, MultiheadAttention) and name == "attn_state":
            if owner.self_attention and mixed_lengths:
                out[full_key] = _pad_self_attention(buffers, rows)
            else:
                out[full_key] = _concat_attention(owner, buffers, rows, source_len)
        elif name == "cached_state" and type(owner).__name__ == "LSTMDecoder":
            out[full_key] = _concat_lstm(buffers)
        else:
            raise FairseqStreamError(UNSUPPORTED.format("{} ({})".format(type(owner).__name__, name)))
    return out


def _pad_self_attention(buffers, rows):
    length = max(b["prev_key"].size(2) for b in buffers)
    joint = {name: torch.cat([_pad(b[name], 2, length, 0.0) for b in buffers])
             for name in ("prev_key", "prev_value")}
    masks = []
    for b, n in zip(buffers, rows):
        own = b.get("prev_key_padding_mask")
        if own is None:
            own = torch.zeros((n, b["prev_key"].size(2)), dtype=torch.bool, device=b["prev_key"].device)
        masks.append(_pad(own.bool(), 1, length, True))
    joint["prev_key_padding_mask"] = torch.cat(masks)
    return joint


def _concat_attention(owner, buffers: List[Dict[str, Optional[Tensor]]], rows: List[int], source_len):
    static = owner.encoder_decoder_attention
    out: Dict[str, Optional[Tensor]] = {}
    for name in ("prev_key", "prev_value"):
        parts = [b[name] for b in buffers]
        if static:
            parts = [_pad(p, 2, source_len, 0.0) for p in parts]
        elif len({p.size(2) for p in parts}) != 1:
            raise FairseqStreamError("internal: joining decoder states of different lengths")
        out[name] = torch.cat(parts, dim=0)
    masks = [b.get("prev_key_padding_mask") for b in buffers]
    if any(m is not None for m in masks):
        template = next(m for m in masks if m is not None)
        filled = []
        for m, b, n in zip(masks, buffers, rows):
            if m is None:
                m = template.new_zeros((n, b["prev_key"].size(2)))
            filled.append(_pad(m, 1, source_len, True) if static else m)
        out["prev_key_padding_mask"] = torch.cat(filled, dim=0)
    elif static and len({b["prev_key"].size(2) for b in buffers}) > 1:
        # No group had padding, but their sources differ in length: mark the padding.
        filled = [torch.zeros((n, b["prev_key"].size(2)), dtype=torch.bool, device=b["prev_key"].device)
                  for b, n in zip(buffers, rows)]
        out["prev_key_padding_mask"] = torch.cat([_pad(m, 1, source_len, True) for m in filled], dim=0)
    else:
        out["prev_key_padding_mask"] = None
    return out


def _concat_lstm(buffers):
    out = {
        "prev_hiddens": torch.cat([b["prev_hiddens"] for b in buffers], dim=1),
        "prev_cells": torch.cat([b["prev_cells"] for b in buffers], dim=1),
    }
    feeds = [b.get("input_feed") for b in buffers]
    out["input_feed"] = None if any(f is None for f in feeds) else torch.cat(feeds, dim=0)
    return out


# -- one decoder call over rows of different prefix lengths (VAR-STR-FIFO) ------


def take_new_step(owners: Dict[str, object], joint: dict, states: List[dict], rows: List[int]):
    """After a mixed call, append each group's new self-attention column / take its LSTM state."""
    from fairseq.modules.multihead_attention import MultiheadAttention

    start = 0
    for state, n in zip(states, rows):
        end = start + n
        for full_key, buffer in joint.items():
            owner_id, _, name = full_key.partition(".")
            owner = owners.get(owner_id)
            if isinstance(owner, MultiheadAttention) and name == "attn_state":
                if not owner.self_attention:
                    continue  # the encoder-side keys did not change
                own = state[full_key]
                state[full_key] = {
                    "prev_key": torch.cat([own["prev_key"], buffer["prev_key"][start:end, :, -1:]], dim=2),
                    "prev_value": torch.cat([own["prev_value"], buffer["prev_value"][start:end, :, -1:]], dim=2),
                    "prev_key_padding_mask": own.get("prev_key_padding_mask"),
                }
            else:  # LSTM cached_state: rows only
                feed = buffer.get("input_feed")
                state[full_key] = {
                    "prev_hiddens": buffer["prev_hiddens"][:, start:end],
                    "prev_cells": buffer["prev_cells"][:, start:end],
                    "input_feed": feed[start:end] if feed is not None else None,
                }
        start = end
