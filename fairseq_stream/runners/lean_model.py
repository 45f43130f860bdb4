"""One fairseq transformer's weights arranged for the lean step, and its encoder keys and values.

:class:`LeanModel` is what the lean runner (:mod:`fairseq_stream.runners.lean`,
single-token steps over segments of rows) and the Jacobi window runner
(:mod:`fairseq_stream.runners.lean_window`, multi-token windows) share: the
arranged weights, the embedding, the layer loop of the Python step, the output
layer, the encoder (:meth:`LeanModel.encode`) and the cache layout.
"""

import bisect
import math
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from fairseq_stream.ops import lean_step, search_loop
from fairseq_stream.runners import lean_encoder
from fairseq_stream.runners.lean_weights import apply_norm, joined_linear, norm_of


class DecoderLayer:
    """One decoder layer's weights, arranged for the step; products are callables (:mod:`fairseq_stream.ops.product`)."""

    def __init__(self, layer, prepack: bool, quantize: Optional[str] = None):
        self_attn, cross = layer.self_attn, layer.encoder_attn

        def product(modules):
            return joined_linear(modules, prepack, quantize)

        self.pre_norm = layer.normalize_before
        self.qkv = product([self_attn.q_proj, self_attn.k_proj, self_attn.v_proj])
        self.self_out = product([self_attn.out_proj])
        self.self_norm = norm_of(layer.self_attn_layer_norm)
        self.scaling = self_attn.scaling
        self.cross_q = product([cross.q_proj])
        self.cross_kv = product([cross.k_proj, cross.v_proj])
        self.cross_out = product([cross.out_proj])
        self.cross_norm = norm_of(layer.encoder_attn_layer_norm)
        self.cross_scaling = cross.scaling
        self.fc1, self.fc2 = product([layer.fc1]), product([layer.fc2])
        self.activation = layer.activation_fn
        self.final_norm = norm_of(layer.final_layer_norm)

    def residual(self, x: Tensor, norm, block) -> Tensor:
        """``x + block(x)`` with ``norm`` applied as fairseq places it: before ``block`` (pre-norm) or after the sum."""
        h = apply_norm(x, norm) if self.pre_norm else x
        x = x + block(h)
        return x if self.pre_norm else apply_norm(x, norm)

    def feed_forward(self, x: Tensor) -> Tensor:
        """The feed-forward sub-layer, with its residual and norm."""
        return self.residual(x, self.final_norm, lambda h: self.fc2(self.activation(self.fc1(h))))


class LeanModel:
    """One fairseq transformer's decoder weights, arranged for the lean step.

    With ``prepack`` (and float32 weights on the CPU) the products hold
    copies packed for MKL (:mod:`fairseq_stream.ops.product`), made
    here: build a new model after changing the parameters (products of 2 and
    3 rows read them, the others the copies). With ``quantize`` ("int8",
    "int16"; float32 CPU weights) every product of the decoder and the
    encoder runs on the weight quantized
    (:func:`fairseq_stream.ops.product.linear`), and no MKL copy is made.
    """

    def __init__(self, model, prepack: bool = True, quantize: Optional[str] = None):
        decoder = model.decoder
        self.model = model
        self.quantize = quantize
        self.embed = decoder.embed_tokens.weight
        self.embed_scale = decoder.embed_scale
        self.padding_idx = decoder.padding_idx

        def product(module):
            return joined_linear([module], prepack, quantize) if module is not None else None

        self.project_in = product(decoder.project_in_dim)
        self.project_out = product(decoder.project_out_dim)
        self.embed_norm = norm_of(decoder.layernorm_embedding)
        self.final_norm = norm_of(decoder.layer_norm)
        self.output = product(decoder.output_projection)
        self.layers = [DecoderLayer(layer, prepack, quantize) for layer in decoder.layers]
        self.compiled = lean_step.compile_layers(self.layers)  # None: the Python step only
        first = decoder.layers[0].self_attn
        self.heads, self.head_dim, self.dim = first.num_heads, first.head_dim, first.embed_dim
        self.positions = self._position_table(decoder)
        self.encoder = None  # None: fairseq's encoder
        # Compiled for the CPU only: elsewhere its joined weights would be a copy nothing reads.
        if lean_encoder.unsupported_reason(model.encoder) is None and model.encoder.embed_tokens.weight.is_cpu:
            self.encoder = lean_encoder.LeanEncoder(
                model.encoder, self._position_table(model.encoder), quantize, prepack)
        self.search_loop = search_loop.describe(self)  # None: the decoder's Python loop only

    @staticmethod
    def _position_table(coder):
        """Every position's embedding of a decoder or encoder, indexed as fairseq does (``padding_idx + prefix length``)."""
        from fairseq.modules import SinusoidalPositionalEmbedding

        module = coder.embed_positions
        if module is None:
            return None
        if isinstance(module, SinusoidalPositionalEmbedding):
            size = module.padding_idx + 2 + coder.max_positions()
            return SinusoidalPositionalEmbedding.get_embedding(
                size, module.embedding_dim, module.padding_idx).to(module.weights)
        return module.weight

    def run_layers(self, x: Tensor, self_attention, encoder_attention) -> Tensor:
        """Every decoder layer over ``x`` with the caller's attentions (the Python step, single-token or window).

        ``self_attention(l, layer, h)`` and ``encoder_attention(l, layer, h)``
        return layer ``l``'s attention output for its normalized input ``h``.
        """
        for l, layer in enumerate(self.layers):
            x = layer.residual(x, layer.self_norm, lambda h: self_attention(l, layer, h))
            x = layer.residual(x, layer.cross_norm, lambda h: encoder_attention(l, layer, h))
            x = layer.feed_forward(x)
        return x

    def new_cache(self, rows: int, positions: int, device, zeroed: bool = False) -> Tensor:
        """Self-attention keys and values, ``(2 * layers, rows, heads, positions, head_dim)``.

        Not zeroed by default (at k=5 and 64 sentences, 63 MB: 22 ms a batch,
        3% of decoding): a single-token step reads only positions its row
        wrote. A window call's torch attention reads every position up to the
        window's end before masking, and an uninitialised NaN there would
        survive the mask: those callers ask for ``zeroed``.
        """
        make = torch.zeros if zeroed else torch.empty
        return make(2 * len(self.layers), rows, self.heads, positions, self.head_dim, dtype=self.embed.dtype,
                    device=device)

    def embed_at(self, tokens: Tensor, where) -> Tensor:
        """The decoder's input for ``tokens`` (flat) at positions ``where``.

        ``where`` indexes the position table (``padding_idx + 1 + prefix
        length``): an int for all tokens, a tensor with one index per token,
        or None for a model without positions.
        """
        x = self.embed_scale * F.embedding(tokens, self.embed)
        if self.project_in is not None:
            x = self.project_in(x)
        if self.positions is not None:
            x = x + (self.positions[where] if isinstance(where, int) else self.positions.index_select(0, where))
        if self.embed_norm is not None:
            x = apply_norm(x, self.embed_norm)
        return x

    def logits(self, x: Tensor) -> Tensor:
        """The output layer's logits from the last decoder layer's states."""
        if self.final_norm is not None:
            x = apply_norm(x, self.final_norm)
        if self.project_out is not None:
            x = self.project_out(x)
        return self.output(x)

    def encode(self, net_input, packed: bool = True):
        """The encoder, then every layer's encoder keys and values, once per sentence.

        With ``packed``, where :class:`LeanEncoder` applies (the CPU, a plain
        fairseq transformer encoder), the batch's tokens are encoded without
        padding in one compiled call (:mod:`fairseq_stream.runners.lean_encoder`).

        Otherwise fairseq's encoder runs. On the CPU a batch of sources of
        very different lengths (batches in input order: mini-batching,
        top-up, a service) is then encoded in groups of similar length
        (:func:`source_groups`): the encoder's products ran every padded
        position of the longest source for every sentence. The groups' keys
        are joined in the batch's order, each sentence's source padded on
        the right (masked): a sentence's keys and values are its own
        encoding's whatever the batch.
        """
        src_tokens = net_input["src_tokens"]
        plain = set(net_input) <= {"src_tokens", "src_lengths", "prev_output_tokens"}
        if packed and plain and self.encoder is not None and self.encoder.applies(src_tokens):
            return self._encode_packed(src_tokens)
        pad = getattr(self.model.encoder, "padding_idx", None)
        if src_tokens.is_cpu and pad is not None and src_tokens.dim() == 2 and plain:
            groups = source_groups(src_tokens.ne(pad).sum(dim=1).tolist(), src_tokens.size(1), ENCODER_CALL_COST)
            if len(groups) > 1:
                parts = []
                for group in groups:
                    index = torch.tensor(group, dtype=torch.long)
                    tokens = src_tokens.index_select(0, index)
                    used = tokens.ne(pad).any(dim=0).nonzero().view(-1)
                    tokens = tokens[:, int(used[0]): int(used[-1]) + 1]
                    sub = {"src_tokens": tokens, "src_lengths": tokens.ne(pad).sum(dim=1)}
                    parts.append(self._encode(sub))
                order = torch.empty(src_tokens.size(0), dtype=torch.long)
                order[torch.tensor([i for g in groups for i in g])] = torch.arange(src_tokens.size(0))
                return EncoderKeys.concat(parts).select(order)
        return self._encode(net_input)

    def _encode(self, net_input):
        out = self.model.encoder.forward_torchscript(net_input)
        enc = out["encoder_out"][0]  # (T, S, C)
        T, S = enc.size(0), enc.size(1)
        keys, values = [], []
        for layer in self.layers:
            kv = layer.cross_kv(enc).view(T, S, 2, self.heads, self.head_dim)
            kv = kv.permute(2, 1, 3, 0, 4)  # (2, S, H, T, hd)
            keys.append(kv[0].contiguous())
            values.append(kv[1].contiguous())
        masks = out.get("encoder_padding_mask") or []
        mask = None
        if masks and masks[0] is not None and masks[0].numel() and bool(masks[0].any()):
            mask = torch.zeros(S, 1, 1, T, dtype=enc.dtype, device=enc.device)
            mask.masked_fill_(masks[0].view(S, 1, 1, T), -math.inf)
        return EncoderKeys(keys, values, mask)

    def _encode_packed(self, src_tokens: Tensor) -> "EncoderKeys":
        """Every decoder layer's encoder keys and values from :class:`LeanEncoder`'s packed states.

        Each sentence's source starts at position 0 and is padded on the
        right (masked, keys and values 0) to the batch's longest.
        """
        states, lengths = self.encoder.encode(src_tokens)
        S, T = lengths.numel(), int(lengths.max())
        ragged = bool(lengths.ne(T).any())
        if ragged:
            keep = torch.arange(T, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)  # (S, T)
            where = keep.view(-1).nonzero().view(-1)
        keys, values = [], []
        for layer in self.layers:
            kv = layer.cross_kv(states)  # (tokens, 2 * dim)
            if ragged:
                kv = kv.new_zeros(S * T, kv.size(1)).index_copy_(0, where, kv)
            kv = kv.view(S, T, 2, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)  # (2, S, H, T, hd)
            keys.append(kv[0].contiguous())
            values.append(kv[1].contiguous())
        mask = None
        if ragged:
            mask = states.new_zeros(S, 1, 1, T).masked_fill_(~keep.view(S, 1, 1, T), -math.inf)
        return EncoderKeys(keys, values, mask)


# A CPU encoder call's fixed cost in source positions (one sentence's token through every layer):
# grouping a batch's sources by length pays where it saves more padded positions than this a group.
# Multi30k transformer, one Xeon thread: a batch of 64 in input order took 72 ms, sorted 40 ms
# (docs/HISTORY.md, top-up), about 37 us a padded position against ~1 ms a call.
ENCODER_CALL_COST = 32


def source_groups(lengths: List[int], padded: int, call_cost: int = ENCODER_CALL_COST) -> List[List[int]]:
    """The batch's sentences (indices) in groups of similar length, encoding fewest positions plus calls.

    One group (the whole batch, as it is) where grouping does not pay;
    otherwise the sentences sorted by length and cut where the positions
    encoded (each group's size times its longest source) plus ``call_cost``
    per group are fewest (dynamic programming over the distinct lengths).
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    ordered = [lengths[i] for i in order]
    values = sorted(set(lengths))
    ends = [bisect.bisect_right(ordered, v) for v in values]  # sentences up to each length
    # best[j]: the cost of encoding the sentences up to the j-th distinct length; cut[j]: its last group's start.
    best, cut = [0] * (len(values) + 1), [0] * (len(values) + 1)
    starts = [0] + ends
    for j in range(1, len(values) + 1):
        best[j], cut[j] = min((best[i] + (ends[j - 1] - starts[i]) * values[j - 1] + call_cost, i) for i in range(j))
    if best[-1] >= len(lengths) * padded + call_cost:
        return [list(range(len(lengths)))]
    groups, j = [], len(values)
    while j > 0:
        groups.append(order[starts[cut[j]]: ends[j - 1]])
        j = cut[j]
    return groups[::-1]


@dataclass
class EncoderKeys:
    """One model's encoder keys and values per layer, ``(sentences, heads, source, head_dim)``."""

    keys: List[Tensor]
    values: List[Tensor]
    mask: Optional[Tensor]  # (sentences, 1, 1, source) additive, or None

    @property
    def sentences(self):
        return self.keys[0].size(0)

    @property
    def source_length(self):
        return self.keys[0].size(2)

    def select(self, sentences: Tensor) -> "EncoderKeys":
        return EncoderKeys(
            [k.index_select(0, sentences) for k in self.keys],
            [v.index_select(0, sentences) for v in self.values],
            self.mask.index_select(0, sentences) if self.mask is not None else None,
        )

    @staticmethod
    def concat(parts: List["EncoderKeys"]) -> "EncoderKeys":
        """Join along sentences, padding sources on the right with masked positions."""
        length = max(p.source_length for p in parts)
        any_mask = any(p.mask is not None for p in parts) or len({p.source_length for p in parts}) > 1

        def pad(t):
            extra = length - t.size(2)
            return F.pad(t, (0, 0, 0, extra)) if extra else t

        mask = None
        if any_mask:
            masks = []
            for p in parts:
                m = p.mask if p.mask is not None else p.keys[0].new_zeros(p.sentences, 1, 1, p.source_length)
                masks.append(F.pad(m, (0, length - p.source_length), value=-math.inf))
            mask = torch.cat(masks)
        layers = range(len(parts[0].keys))
        return EncoderKeys(
            [torch.cat([pad(p.keys[i]) for p in parts]) for i in layers],
            [torch.cat([pad(p.values[i]) for p in parts]) for i in layers],
            mask,
        )
