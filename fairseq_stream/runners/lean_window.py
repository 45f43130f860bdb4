"""Multi-token incremental decoder calls on the lean runner's weights (for Jacobi decoding).

A Jacobi iteration feeds each row a *window* of tokens: the last verified
token, then draft guesses for the positions after it. The rows' verified
prefixes differ in length, so every row has its own start position, and
their windows may differ in width (a row with nothing worth drafting runs
one position, a greedy step): the window is laid out flat, position n being
row ``rows[n]``'s token at cache position ``steps[n]`` (:class:`WindowLayout`,
built on the host from lengths the decoder already knows: no device read).
One call:

* embeds the window at explicit positions (``padding_idx + 1 + step``, as
  fairseq's incremental step numbers a prefix of ``step`` tokens): a draft
  token is only a token, never key padding, whatever its value;
* writes the window's self-attention keys and values into each row's
  preallocated cache at its steps and attends over the cache with a mask that
  lets a position see its row's positions up to its own (causal inside the
  window, the verified prefix reused as it is): on the CPU one compiled call
  (:func:`fairseq_stream.ops.attention.window_attention_`), and the encoder
  attention the lean runner's compiled one, each position reading its
  sentence's keys;
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

    encoder: List[_EncoderKeys]  # per model, by slot
    caches: List[Tensor]  # per model (2 * layers, slots, heads, capacity, head_dim)
    lengths: List[int]  # per row, verified positions in the cache (on the host: the decoder knows them)
    slots: List[int]  # per row, its slot in ``caches`` and ``encoder``


@dataclass
class WindowLayout:
    """One window call's positions, flat: position n is row ``rows[n]``'s ``tokens[n]`` at cache position ``steps[n]``."""

    tokens: Tensor  # (positions,)
    rows: Tensor  # (positions,) the row's slot in the caches and encoder keys
    steps: Tensor  # (positions,)
    widths: List[int]  # per row (host)
    slots: List[int]  # per row, its slot (host)
    needed: int  # max(steps) + 1 (host)

    @staticmethod
    def build(windows: List[List[int]], lengths: List[int], slots: List[int], device) -> "WindowLayout":
        """Row r's window ``windows[r]`` (its last verified token first) at steps ``lengths[r]`` on, in cache slot ``slots[r]``."""
        tokens, rows, steps = [], [], []
        for window, length, slot in zip(windows, lengths, slots):
            tokens += window
            rows += [slot] * len(window)
            steps += range(length, length + len(window))
        flat = torch.tensor([tokens, rows, steps], dtype=torch.long)
        if flat.device != device:
            flat = flat.to(device)
        return WindowLayout(flat[0], flat[1], flat[2], [len(w) for w in windows], slots,
                            max(l + len(w) for w, l in zip(windows, lengths)))

    @property
    def positions(self) -> int:
        return sum(self.widths)

    def packing(self):
        """The positions' places when packed by slot, (where, widest), for the torch encoder attention."""
        widest = max(self.widths)
        where = [slot * widest + j for slot, w in zip(self.slots, self.widths) for j in range(w)]
        return torch.tensor(where, dtype=torch.long).to(self.tokens.device), widest


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
        return WindowState(encoder, caches, [0] * rows, list(range(rows)))

    @staticmethod
    def layout(state: WindowState, windows: List[List[int]]) -> WindowLayout:
        """:meth:`WindowLayout.build` of row r's window ``windows[r]`` at its verified length, in its slot."""
        return WindowLayout.build(windows, state.lengths, state.slots, state.caches[0].device)

    @torch.no_grad()
    def window(self, state: WindowState, layout: WindowLayout) -> List[Tensor]:
        """Every model's logits for the window ``layout`` (built from ``state.lengths``).

        Returns:
            one (positions, vocab) tensor per model, in the layout's order, in
            the model's type, before ``--temperature``.
        """
        if layout.needed > state.caches[0].size(3):
            capacity = max(layout.needed, 2 * state.caches[0].size(3))
            # Every slot is copied, ended ones too (their contents are never read again).
            state.caches = [self._grown(c, capacity, max(state.lengths)) for c in state.caches]
        return [self._model_window(i, lean, state, layout) for i, lean in enumerate(self.lean)]

    @staticmethod
    def commit(state: WindowState, accepted: List[int]):
        """Extend each row's verified prefix by ``accepted`` (per row) positions."""
        state.lengths = [length + m for length, m in zip(state.lengths, accepted)]

    @staticmethod
    def keep(state: WindowState, rows: List[int]) -> WindowState:
        """A state holding only ``rows`` (finished sentences dropped).

        The caches and encoder keys keep ended rows' slots until at most half
        of them are live: copying every cache each time a sentence ends cost
        Jacobi more than its window's work at 64 rows.
        """
        slots = [state.slots[r] for r in rows]
        lengths = [state.lengths[r] for r in rows]
        if 2 * len(slots) > state.caches[0].size(1):
            return WindowState(state.encoder, state.caches, lengths, slots)
        index = torch.tensor(slots, dtype=torch.long).to(state.caches[0].device)
        return WindowState(
            [e.select(index) for e in state.encoder],
            [c.index_select(1, index) for c in state.caches],
            lengths,
            list(range(len(slots))),
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

    def _model_window(self, index: int, lean, state: WindowState, layout: WindowLayout) -> Tensor:
        D = lean.dim
        position = None
        if lean.positions is not None:
            # Positions past the table (a window reaching beyond a sentence's
            # maximum length) are clamped: their outputs are never accepted.
            position = (layout.steps + lean.padding_idx + 1).clamp(max=lean.positions.size(0) - 1)
        x = lean.embed_at(layout.tokens, position)
        cache = state.caches[index]
        encoder = state.encoder[index]
        # The lean runner's compiled attentions where they apply (its option too), else torch's.
        compiled = self.runner.compiled_attention and attention.compiled_applies(x)
        if compiled and self.runner.compiled_step and lean.compiled is not None:
            # The same calls from C++ (bitwise the same results; ops/lean_step.py).
            x = lean_step.lean_window_layers(x, lean.compiled, cache, layout.rows, layout.steps, encoder.keys,
                                             encoder.values, encoder.mask)
            return lean.logits(x)
        packing = None if compiled else layout.packing()
        for l, layer in enumerate(lean.layers):

            def self_attention(h):
                q, k, v = layer.qkv(h).split(D, dim=-1)
                out = attention.window_attention_(q, k, v, cache[2 * l], cache[2 * l + 1], layout.rows,
                                                  layout.steps, layout.needed, layer.scaling, compiled)
                return layer.self_out(out)

            def encoder_attention(h):
                # Each window position reads its own sentence's keys.
                out = attention.source_attention(layer.cross_q(h), encoder.keys[l], encoder.values[l], encoder.mask,
                                                 layer.cross_scaling, layout.rows, packing, compiled)
                return layer.cross_out(out)

            x = layer.residual(x, layer.self_norm, self_attention)
            x = layer.residual(x, layer.cross_norm, encoder_attention)
            x = layer.feed_forward(x)
        return lean.logits(x)
