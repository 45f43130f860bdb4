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

A row's window may also be a *tree* of drafts (several candidate
continuations sharing their first tokens, ``--jacobi-candidates``): each
window position has a parent, is embedded at its depth after the verified
prefix, is cached at its own place in the window, and attends over the
prefix and its ancestors only (a ``visible`` mask). A row whose accepted path
leaves the window's first branch has that path's keys and values moved into
place at commit: a copy of the accepted positions only.

One row is one sentence (greedy has one hypothesis): encoder keys and values
are indexed by row, computed once per sentence by :meth:`LeanModel.encode`.
"""

from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import Tensor

from fairseq_stream.ops import attention, lean_step
from fairseq_stream.runners.lean import INITIAL_CAPACITY, LeanRunner
from fairseq_stream.runners.lean_model import EncoderKeys


@dataclass
class WindowState:
    """Rows decoded by windows: per-model caches, encoder keys, and each row's verified length."""

    encoder: List[EncoderKeys]  # per model, by slot
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
    # Tree-shaped windows only (else None): the step each position is embedded at (its row's
    # length + its depth), and the self-attention mask (positions, needed), additive.
    embed_steps: Optional[Tensor] = None
    visible: Optional[Tensor] = None

    @staticmethod
    def build(windows: List[List[int]], lengths: List[int], slots: List[int], device,
              parents: Optional[List[Optional[List[int]]]] = None, dtype=torch.float32) -> "WindowLayout":
        """Row r's window ``windows[r]`` (its last verified token first) at steps ``lengths[r]`` on, in cache slot ``slots[r]``.

        ``parents[r]``, where given, makes row r's window a tree: the window
        index of each position's parent (-1 for the first position, every
        other parent before its child); None is a chain (parent = the
        position before). ``dtype``: the mask's, the cache's type.
        """
        tokens, rows, steps = [], [], []
        for window, length, slot in zip(windows, lengths, slots):
            tokens += window
            rows += [slot] * len(window)
            steps += range(length, length + len(window))
        needed = max(l + len(w) for w, l in zip(windows, lengths))
        trees = parents is not None and any(p is not None for p in parents)
        flat = torch.tensor([tokens, rows, steps] + ([_embed_steps(windows, lengths, parents)] if trees else []),
                            dtype=torch.long)
        if flat.device != device:
            flat = flat.to(device)
        layout = WindowLayout(flat[0], flat[1], flat[2], [len(w) for w in windows], slots, needed)
        if trees:
            layout.embed_steps = flat[3]
            layout.visible = _tree_mask(windows, lengths, parents, needed, dtype).to(device)
        return layout

    @property
    def positions(self) -> int:
        return sum(self.widths)

    def packing(self):
        """The positions' places when packed by slot, (where, widest), for the torch encoder attention."""
        widest = max(self.widths)
        where = [slot * widest + j for slot, w in zip(self.slots, self.widths) for j in range(w)]
        return torch.tensor(where, dtype=torch.long).to(self.tokens.device), widest


def depths(parents: List[int]) -> List[int]:
    """Each window position's depth in its tree (0 for the first position), from its parents."""
    out: List[int] = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def _embed_steps(windows, lengths, parents) -> List[int]:
    out: List[int] = []
    for window, length, tree in zip(windows, lengths, parents):
        out += [length + d for d in depths(tree)] if tree is not None else range(length, length + len(window))
    return out


def _tree_mask(windows, lengths, parents, needed: int, dtype) -> Tensor:
    """(positions, needed) additive: 0 where a window position may attend (its prefix, its ancestors and itself)."""
    hidden = float("-inf")
    rows = []
    for window, length, tree in zip(windows, lengths, parents):
        width = len(window)
        for j in range(width):
            row = [0.0] * length + [hidden] * (needed - length)
            if tree is None:
                row[length: length + j + 1] = [0.0] * (j + 1)
            else:
                p = j
                while p >= 0:
                    row[length + p] = 0.0
                    p = tree[p]
            rows.append(row)
    return torch.tensor(rows, dtype=dtype)


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
        encoder = [m.encode(net_input, self.runner.packed_encoder) for m in self.lean]
        rows = net_input["src_tokens"].size(0)
        device = net_input["src_tokens"].device
        caches = [m.new_cache(rows, INITIAL_CAPACITY, device, zeroed=True) for m in self.lean]
        return WindowState(encoder, caches, [0] * rows, list(range(rows)))

    @staticmethod
    def layout(state: WindowState, windows: List[List[int]], parents=None) -> WindowLayout:
        """:meth:`WindowLayout.build` of row r's window ``windows[r]`` (a tree where ``parents[r]`` is given)
        at its verified length, in its slot."""
        return WindowLayout.build(windows, state.lengths, state.slots, state.caches[0].device, parents,
                                  state.caches[0].dtype)

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
    def commit(state: WindowState, accepted: List[int], paths: Optional[List[Optional[List[int]]]] = None):
        """Extend each row's verified prefix by ``accepted`` (per row) positions.

        ``paths[r]``, where given: the window indices of row r's accepted
        positions in a tree-shaped window (``accepted[r]`` of them, the
        first 0); those not already in place are copied to follow the prefix.
        """
        if paths is not None:
            moves = [(slot, length + i, length + j)
                     for slot, length, path in zip(state.slots, state.lengths, paths) if path is not None
                     for i, j in enumerate(path) if i != j]
            if moves:
                slot, dst, src = torch.tensor(moves, dtype=torch.long).t().to(state.caches[0].device)
                for cache in state.caches:
                    cache[:, slot, :, dst] = cache[:, slot, :, src]
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
            steps = layout.steps if layout.embed_steps is None else layout.embed_steps
            position = (steps + lean.padding_idx + 1).clamp(max=lean.positions.size(0) - 1)
        x = lean.embed_at(layout.tokens, position)
        cache = state.caches[index]
        encoder = state.encoder[index]
        # The lean runner's compiled attentions where they apply (its option too), else torch's.
        compiled = self.runner.compiled_attention and attention.compiled_applies(x)
        if compiled and self.runner.compiled_step and lean.compiled is not None:
            # The same calls from C++ (bitwise the same results; ops/lean_step.py).
            x = lean_step.lean_window_layers(x, lean.compiled, cache, layout.rows, layout.steps, encoder.keys,
                                             encoder.values, encoder.mask, layout.visible)
            return lean.logits(x)
        packing = None if compiled else layout.packing()
        def self_attention(l, layer, h):
            q, k, v = layer.qkv(h).split(D, dim=-1)
            out = attention.window_attention_(q, k, v, cache[2 * l], cache[2 * l + 1], layout.rows, layout.steps,
                                              layout.needed, layer.scaling, compiled, layout.visible)
            return layer.self_out(out)

        def encoder_attention(l, layer, h):
            # Each window position reads its own sentence's keys.
            out = attention.source_attention(layer.cross_q(h), encoder.keys[l], encoder.values[l], encoder.mask,
                                             layer.cross_scaling, layout.rows, packing, compiled)
            return layer.cross_out(out)

        x = lean.run_layers(x, self_attention, encoder_attention)
        return lean.logits(x)
