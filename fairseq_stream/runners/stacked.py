"""An ensemble's members stacked: each product of the lean step run once for all members.

The lean runner steps an ensemble member by member: N times each product,
attention call, layer norm and residual sum, then N logits. Members of one
shape (the WMT'19 systems: four transformer-big of one architecture) can run
as one model instead. :class:`StackedModel` holds the members' weights
stacked on a leading member axis, and :func:`step` runs a single-token step
of all members at once:

* the residual stream is ``(members, rows, dim)``; a product is one
  ``baddbmm`` over ``(members, rows, in) x (members, in, out)`` where the
  members' products read fairseq's weights (CUDA, float64); where each
  member holds its own copy of a weight (float32 on the CPU, packed for
  MKL; ``--quantize``), each member's product runs on its slice (no third
  copy of the weights; those rows get member by member's bits);
* attention folds the members into the heads: member m's head h is head
  ``m * heads + h`` of one cache ``(2 * layers, slots, members * heads,
  capacity, head_dim)`` and of one set of encoder keys ``(sentences, members
  * heads, source, head_dim)``, so each attention is one call for all
  members, and the lean runner's segments, reorders and merges handle one
  cache as for a single model;
* layer norms run over all members at once (normalize, then each member's
  weight and bias); the output layer returns one logits tensor per member,
  views of one ``(members, rows, vocab)`` product, for the fused output
  layer or the average of the members' log-probabilities.

What stays member by member: the embedding where the products are each
member's own (batched, one lookup in the stacked output projection's copy of
the shared tables), the encoder (each member's, then its keys joined along
the heads), Jacobi's window calls (:mod:`fairseq_stream.runners.lean_window`)
and the compiled search loops (:mod:`fairseq_stream.ops.search_loop`).

Exactness: the members' arithmetic, the products batched and the norm's
affine step separate; in float64 an ensemble's n-best lists equal the
member-by-member runner's, scores within 1e-9 (tests/test_stacked.py).
On the CPU in float32 and quantized, the stacked step's results are bitwise
the member-by-member step's (tests/test_stacked.py). Memory: batched
products hold a stacked copy of the members' decoder weights (the output
projection too); the others share the members'.
"""

from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from fairseq_stream.ops import attention
from fairseq_stream.ops.product import TorchLinear
from fairseq_stream.runners.lean_model import EncoderKeys, LeanModel


def unstackable_reason(members: List[LeanModel]) -> Optional[str]:
    """Why ``members`` cannot be stacked (None where they can): fewer than two, or of different shapes."""
    if len(members) < 2:
        return "one model"
    first = members[0]
    for i, m in enumerate(members[1:], 2):
        if _shape(m) != _shape(first):
            return "model {} has another shape than model 1".format(i)
    return None


def _shape(m: LeanModel):
    """What must be equal for two members to stack: every decoder parameter's shape and the step's settings."""
    decoder = m.model.decoder
    layers = tuple((l.pre_norm, l.activation, l.scaling, l.cross_scaling,
                    tuple(n[3] if n is not None else None for n in (l.self_norm, l.cross_norm, l.final_norm)))
                   for l in m.layers)
    return (tuple(tuple(p.shape) for p in decoder.parameters()), m.embed.dtype, m.embed.device, m.heads,
            m.head_dim, m.dim, m.padding_idx, m.embed_scale, m.quantize, layers,
            tuple(x is None for x in (m.project_in, m.project_out, m.embed_norm, m.final_norm, m.positions)),
            tuple(n[3] for n in (m.embed_norm, m.final_norm) if n is not None),
            getattr(m.model.encoder, "padding_idx", None))


def choose(members: List[LeanModel], stack_members: Optional[bool], auto_declined: str,
           quantize: Optional[str] = None):
    """(a :class:`StackedModel` or None, why not: "" where stacked), for a runner's ``--stack-members``.

    ``stack_members``: True, False, or None (auto: stacked unless
    ``auto_declined`` says why not, the runner's own rule).
    """
    if stack_members is None:
        declined = auto_declined
    else:
        declined = "" if stack_members else "--stack-members off"
    reason = unstackable_reason(members) or declined
    return (None if reason else StackedModel(members, quantize)), reason


class StackedProduct:
    """One product of every member: ``x`` (members, rows, in) to (members, rows, out).

    Where the members' products read fairseq's weights as they are
    (``TorchLinear``: CUDA, float64, ``prepack=False``): the weights stacked
    once, one ``baddbmm``. Where each member's product holds a copy of its
    own (MKL-packed float32 on the CPU, ``--quantize``): each member's
    product on its slice, so no third copy of the weights, and each member's
    rows get the same bits as member by member.
    """

    def __init__(self, modules: List[List[torch.nn.Linear]], members: List, quantize: Optional[str]):
        batched = quantize is None and all(isinstance(p, TorchLinear) for p in members)
        self.members = None if batched else members
        self.weight = self.bias = None
        if batched:
            # (members, out, in): each member's joined weight, as joined_linear joins it.
            self.weight = torch.stack([torch.cat([m.weight.detach() for m in group]) for group in modules])
            if modules[0][0].bias is not None:
                self.bias = torch.stack([torch.cat([m.bias.detach() for m in group]) for group in modules]).unsqueeze(1)

    def __call__(self, x: Tensor) -> Tensor:
        if self.members is not None:
            return torch.stack(self.each(x))
        weight = self.weight.transpose(1, 2)
        if self.bias is None:
            return torch.bmm(x, weight)
        return torch.baddbmm(self.bias, x, weight)

    def each(self, x: Tensor) -> List[Tensor]:
        """Each member's (rows, out), without joining them (the output layer's logits: no stacked copy)."""
        if self.members is not None:
            return [p(x[i].contiguous()) for i, p in enumerate(self.members)]
        return list(self(x).unbind(0))


def stacked_norm(norms):
    """The members' LayerNorms as (weight (members, 1, dim), bias, eps), or None where they have none."""
    if norms[0] is None:
        return None
    dim = norms[0][0][-1]

    def stacked(values, fill):
        # A LayerNorm without an affine step multiplies by 1 and adds 0.
        return torch.stack([v.detach() if v is not None else fill(dim) for v in values]).unsqueeze(1)

    first = norms[0][1] if norms[0][1] is not None else norms[0][2]
    like = dict(dtype=first.dtype, device=first.device) if first is not None else {}
    return (stacked([n[1] for n in norms], lambda d: torch.ones(d, **like)),
            stacked([n[2] for n in norms], lambda d: torch.zeros(d, **like)), norms[0][3])


def apply_stacked_norm(x: Tensor, norm) -> Tensor:
    """Each member's LayerNorm over its slice of ``x`` (members, rows, dim)."""
    weight, bias, eps = norm
    return torch.addcmul(bias, F.layer_norm(x, (x.size(-1),), None, None, eps), weight)


class StackedLayer:
    """One decoder layer of every member, stacked (the members' ``DecoderLayer`` settings are equal)."""

    def __init__(self, index: int, members: List[LeanModel], quantize: Optional[str]):
        layers = [m.model.decoder.layers[index] for m in members]
        lean = [m.layers[index] for m in members]

        def product(pick, name):
            return StackedProduct([pick(layer) for layer in layers], [getattr(l, name) for l in lean], quantize)

        self.qkv = product(lambda l: [l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj], "qkv")
        self.self_out = product(lambda l: [l.self_attn.out_proj], "self_out")
        self.cross_q = product(lambda l: [l.encoder_attn.q_proj], "cross_q")
        self.cross_out = product(lambda l: [l.encoder_attn.out_proj], "cross_out")
        self.fc1 = product(lambda l: [l.fc1], "fc1")
        self.fc2 = product(lambda l: [l.fc2], "fc2")
        first = lean[0]
        self.pre_norm, self.activation = first.pre_norm, first.activation
        self.scaling, self.cross_scaling = first.scaling, first.cross_scaling
        self.self_norm = stacked_norm([l.self_norm for l in lean])
        self.cross_norm = stacked_norm([l.cross_norm for l in lean])
        self.final_norm = stacked_norm([l.final_norm for l in lean])

    def residual(self, x: Tensor, norm, block) -> Tensor:
        """``x + block(x)`` with ``norm`` where fairseq places it (``DecoderLayer.residual``, every member at once)."""
        h = apply_stacked_norm(x, norm) if self.pre_norm else x
        x = x + block(h)
        return x if self.pre_norm else apply_stacked_norm(x, norm)


class StackedModel:
    """Members of one shape (:func:`unstackable_reason` is None) as one model for :func:`step`.

    ``members``: the lean runner's ``LeanModel`` of each member (their
    embeddings, encoders and quantized products are used as they are).
    """

    def __init__(self, members: List[LeanModel], quantize: Optional[str] = None):
        self.members = members
        first = members[0]
        self.count = len(members)
        self.dim, self.head_dim = first.dim, first.head_dim
        self.heads = self.count * first.heads  # every member's heads, member after member
        decoders = [m.model.decoder for m in members]
        self.layers = [StackedLayer(i, members, quantize) for i in range(len(first.layers))]
        self.final_norm = stacked_norm([m.final_norm for m in members])
        self.project_out = None
        if first.project_out is not None:
            self.project_out = StackedProduct([[d.project_out_dim] for d in decoders],
                                              [m.project_out for m in members], quantize)
        self.output = StackedProduct([[d.output_projection] for d in decoders], [m.output for m in members], quantize)
        self.embed_scale = first.embed_scale
        self.tables = self._stacked_tables(decoders)

    def _stacked_tables(self, decoders):
        """(token tables (members, vocab, dim), position tables (members, positions, dim) or None) where the
        stacked output projection already holds the token tables (fairseq's shared input and output embedding,
        batched products): one lookup for all members at the cost of the small position tables. Else None:
        each member's own lookup."""
        members = self.members
        if self.output.weight is None or any(m.project_in is not None or m.embed_norm is not None or
                                             d.output_projection.weight is not m.embed
                                             for m, d in zip(members, decoders)):
            return None
        positions = [m.positions for m in members]
        if positions[0] is None:
            return self.output.weight, None
        if len({tuple(p.shape) for p in positions}) > 1:
            return None
        return self.output.weight, torch.stack(positions)

    def new_cache(self, rows: int, positions: int, device, zeroed: bool = False) -> Tensor:
        """Every member's self-attention keys and values: ``(2 * layers, rows, members * heads, positions,
        head_dim)`` (``zeroed``: as :meth:`LeanModel.new_cache`)."""
        make = torch.zeros if zeroed else torch.empty
        return make(2 * len(self.layers), rows, self.heads, positions, self.head_dim,
                    dtype=self.members[0].embed.dtype, device=device)

    def encode(self, net_input, packed: bool = True) -> EncoderKeys:
        """Each member's encoder keys and values, joined along the heads (member after member)."""
        parts = [m.encode(net_input, packed) for m in self.members]
        layers = range(len(parts[0].keys))
        # The members share the source and its padding, so its mask.
        return EncoderKeys([torch.cat([p.keys[l] for p in parts], dim=1) for l in layers],
                           [torch.cat([p.values[l] for p in parts], dim=1) for l in layers], parts[0].mask)

    def embed_at(self, tokens: Tensor, where) -> Tensor:
        """Every member's decoder input, ``(members, rows, dim)`` (:meth:`LeanModel.embed_at`'s arithmetic)."""
        if self.tables is None:
            return torch.stack([m.embed_at(tokens, where) for m in self.members])
        embed, positions = self.tables
        x = self.embed_scale * embed.index_select(1, tokens)
        if positions is not None:
            x = x + (positions[:, where].unsqueeze(1) if isinstance(where, int) else positions.index_select(1, where))
        return x

    def logits(self, x: Tensor) -> List[Tensor]:
        """Each member's logits (rows, vocab) from ``x`` (members, rows, dim) (batched: views of one product)."""
        if self.final_norm is not None:
            x = apply_stacked_norm(x, self.final_norm)
        if self.project_out is not None:
            x = self.project_out(x)
        return self.output.each(x)

    def run_layers(self, x: Tensor, self_attention, encoder_attention) -> Tensor:
        """Every layer over ``x`` (members, rows, dim) with the caller's attentions (:meth:`LeanModel.run_layers`)."""
        for l, layer in enumerate(self.layers):
            x = layer.residual(x, layer.self_norm, lambda h: self_attention(l, layer, h))
            x = layer.residual(x, layer.cross_norm, lambda h: encoder_attention(l, layer, h))
            x = layer.residual(x, layer.final_norm, lambda h: layer.fc2(layer.activation(layer.fc1(h))))
        return x

    def step(self, last_tokens: Tensor, position, self_attention, source_attention) -> List[Tensor]:
        """One single-token step of every member; each member's logits.

        The attentions are the caller's, over every member's heads in one
        call (member m's head h is head ``m * heads + h``):
        ``self_attention(l, layer, q, k, v)`` and ``source_attention(l,
        layer, q)`` take rows ``(rows, members * dim)`` and return the same
        shape. ``position``: as :meth:`LeanModel.embed_at`'s ``where``.
        """
        D, N = self.dim, self.count
        x = self.embed_at(last_tokens, position)

        def self_block(l, layer, h):
            q, k, v = (_by_rows(part) for part in layer.qkv(h).split(D, dim=-1))
            return layer.self_out(_by_members(self_attention(l, layer, q, k, v), N))

        def source_block(l, layer, h):
            return layer.cross_out(_by_members(source_attention(l, layer, _by_rows(layer.cross_q(h))), N))

        return self.logits(self.run_layers(x, self_block, source_block))


def _by_rows(x: Tensor) -> Tensor:
    """(members, rows, dim) as (rows, members * dim): a row's heads, member after member (a copy)."""
    return x.transpose(0, 1).reshape(x.size(1), -1)


def _by_members(x: Tensor, members: int) -> Tensor:
    """(rows, members * dim) as (members, rows, dim) (a view)."""
    return x.view(x.size(0), members, -1).transpose(0, 1)


def step(model: StackedModel, segments, bounds, last_tokens: Tensor, position, compiled: bool) -> List[Tensor]:
    """One single-token step of every member over the lean runner's segments; each member's logits.

    ``segments``: the runner's segments (``caches[0]`` and ``encoder[0]``
    stacked: :meth:`StackedModel.new_cache`, :meth:`StackedModel.encode`),
    rows ``bounds[i]`` of ``last_tokens`` each; ``position``: the position
    table's index (an int, a tensor per row, or None); ``compiled``: the
    compiled attention kernels where they apply.
    """
    def joined(outs):
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def self_attention(l, layer, q, k, v):
        return joined([attention.cached_attention_(q[a:b], k[a:b], v[a:b], s.caches[0][2 * l],
                                                   s.caches[0][2 * l + 1], s.slot, s.length, layer.scaling, compiled)
                       for s, (a, b) in zip(segments, bounds)])

    def source_attention(l, layer, q):
        outs = []
        for s, (a, b) in zip(segments, bounds):
            enc = s.encoder[0]
            outs.append(attention.source_attention(q[a:b], enc.keys[l], enc.values[l], enc.mask, layer.cross_scaling,
                                                   s.row_sentence, None if compiled else s.packing(), compiled))
        return joined(outs)

    return model.step(last_tokens, position, self_attention, source_attention)
