"""Multi-token incremental decoder calls on the lean runner's weights (for Jacobi decoding).

A Jacobi iteration feeds each row a *window* of tokens: the last verified
token, then draft guesses for the positions after it. The rows' verified
prefixes differ in length, so every row has its own start position. One call:

* embeds the window at explicit positions (``padding_idx + 1 + start + j``,
  as fairseq's incremental step numbers a prefix of ``start + j`` tokens): a
  draft token is only a token, never key padding, whatever its value;
* writes the window's self-attention keys and values into each row's
  preallocated cache at ``start .. start + W - 1`` and attends over the cache
  with a mask that lets window position ``j`` see positions ``<= start + j``
  (causal inside the window, the verified prefix reused as it is): on the
  CPU one compiled call (:func:`fairseq_stream.ops.attention.window_attention_`),
  and the encoder attention the lean runner's compiled one, each window row
  reading its sentence's keys;
* returns every window position's logits, one tensor per model.

:meth:`WindowRunner.commit` then extends each row's verified prefix by the
number of tokens its iteration accepted: the keys and values of those
positions were computed from verified inputs, so they stay; the rest of the
window is overwritten by the next call. Nothing is copied to accept tokens.

One row is one sentence (greedy has one hypothesis): encoder keys and values
are indexed by row, computed once per sentence by :meth:`LeanModel.encode`.
"""

from dataclasses import dataclass
from typing import List

import torch
from torch import Tensor

from fairseq_stream.ops import attention, lean_step
from fairseq_stream.runners.lean import LeanRunner, _EncoderKeys


@dataclass
class WindowState:
    """Rows decoded by windows: per-model caches, encoder keys, and each row's verified length."""

    encoder: List[_EncoderKeys]  # per model, sentence i = row i
    caches: List[Tensor]  # per model (2 * layers, rows, heads, capacity, head_dim)
    lengths: Tensor  # (rows,) verified positions in the cache
    longest: int  # max(lengths), kept on the host (no read of ``lengths``)

    @property
    def rows(self) -> int:
        return self.lengths.numel()


class WindowRunner:
    """Window calls over a :class:`LeanRunner`'s models (an ensemble of any size).

    Args:
        lean_runner: the runner whose arranged weights (``LeanModel``) are used.
    """

    def __init__(self, lean_runner: LeanRunner):
        self.runner = lean_runner

    @property
    def lean(self):
        # Read through the runner: ``cuda()`` rebuilds its arranged weights.
        return self.runner.lean

    @torch.no_grad()
    def start(self, net_input) -> WindowState:
        """Encode ``net_input``; one row per sentence, nothing decoded yet."""
        encoder = [m.encode(net_input) for m in self.lean]
        rows = net_input["src_tokens"].size(0)
        device = net_input["src_tokens"].device
        caches = [self._new_cache(m, rows, 32, device) for m in self.lean]
        return WindowState(encoder, caches, torch.zeros(rows, dtype=torch.long, device=device), 0)

    @torch.no_grad()
    def window(self, state: WindowState, tokens: Tensor) -> List[Tensor]:
        """Every model's logits for each row's window ``tokens`` (rows, W), at the row's own start.

        Returns:
            one (rows * W, vocab) tensor per model, row-major (row r's
            position j is entry ``r * W + j``), in the model's type, before
            ``--temperature``.
        """
        rows, width = tokens.shape
        needed = state.longest + width
        if needed > state.caches[0].size(3):
            capacity = max(needed, 2 * state.caches[0].size(3))
            state.caches = [self._grown(c, capacity, state.longest) for c in state.caches]
        steps = state.lengths.unsqueeze(1) + torch.arange(width, device=tokens.device)  # (rows, W)
        visible = torch.arange(needed, device=tokens.device).view(1, 1, 1, needed) <= steps.view(rows, 1, width, 1)
        return [self._model_window(i, lean, state, tokens, steps, visible)
                for i, lean in enumerate(self.lean)]

    @staticmethod
    def commit(state: WindowState, accepted: Tensor, longest: int):
        """Extend each row's verified prefix by ``accepted`` (rows,) positions; ``longest``: the new max length."""
        state.lengths += accepted
        state.longest = longest

    @staticmethod
    def keep(state: WindowState, rows: Tensor, longest: int) -> WindowState:
        """A state holding only ``rows`` (finished sentences dropped); ``longest``: their max length."""
        return WindowState(
            [e.select(rows) for e in state.encoder],
            [c.index_select(1, rows) for c in state.caches],
            state.lengths.index_select(0, rows),
            longest,
        )

    # -- internals ---------------------------------------------------------

    @staticmethod
    def _new_cache(lean, rows: int, positions: int, device):
        return torch.zeros(2 * len(lean.layers), rows, lean.heads, positions, lean.head_dim,
                           dtype=lean.embed.dtype, device=device)

    @staticmethod
    def _grown(cache: Tensor, positions: int, length: int) -> Tensor:
        new = cache.new_zeros(cache.size(0), cache.size(1), cache.size(2), positions, cache.size(4))
        new[:, :, :, :length] = cache[:, :, :, :length]
        return new

    def _model_window(self, index: int, lean, state: WindowState, tokens: Tensor, steps: Tensor,
                      visible: Tensor) -> Tensor:
        rows, width = tokens.shape
        H, hd, D = lean.heads, lean.head_dim, lean.dim
        position = None
        if lean.positions is not None:
            # Positions past the table (a window reaching beyond a sentence's
            # maximum length) are clamped: their outputs are never accepted.
            position = (steps.reshape(-1) + lean.padding_idx + 1).clamp(max=lean.positions.size(0) - 1)
        x = lean.embed_at(tokens.reshape(-1), position)
        cache = state.caches[index]
        encoder = state.encoder[index]
        # The lean runner's compiled attentions where they apply (its option too), else torch's.
        compiled = self.runner.compiled_attention and attention.compiled_applies(x)
        starts = steps[:, 0]
        window_sentence = torch.arange(rows, device=tokens.device).repeat_interleave(width) if compiled else None
        if compiled and self.runner.compiled_step and lean.compiled is not None:
            # The same calls from C++ (bitwise the same results; ops/lean_step.py).
            x = lean_step.lean_window_layers(x, lean.compiled, cache, starts, width, encoder.keys, encoder.values,
                                             encoder.mask, window_sentence)
            return lean.logits(x)
        for l, layer in enumerate(lean.layers):

            def self_attention(h):
                q, k, v = layer.qkv(h).split(D, dim=-1)
                out = attention.window_attention_(q, k, v, cache[2 * l], cache[2 * l + 1], starts, steps, visible,
                                                  layer.scaling, compiled)
                return layer.self_out(out)

            def encoder_attention(h):
                q = layer.cross_q(h)
                if compiled:  # each window row reads its own sentence's keys
                    out = attention.source_attention(q, encoder.keys[l], encoder.values[l], encoder.mask,
                                                     layer.cross_scaling, window_sentence)
                else:
                    out = attention.attend_packed_source(q.view(rows, width, H, hd), encoder.keys[l],
                                                         encoder.values[l], encoder.mask, layer.cross_scaling)
                return layer.cross_out(out.reshape(rows * width, D))

            x = layer.residual(x, layer.self_norm, self_attention)
            x = layer.residual(x, layer.cross_norm, encoder_attention)
            x = layer.feed_forward(x)
        return lean.logits(x)
