"""The lean runner: our own incremental decoder step for fairseq transformers.

fairseq's incremental step pays, per call and per layer, for module dispatch,
dict look-ups of its incremental state, concatenating every self-attention
cache to append one position, and (with rows that move across sentences, as
ours do) a copy of the encoder keys and values for every row. This runner
reads a ``TransformerModel``'s weights once and runs the step itself:

* self-attention keys and values live in one preallocated tensor per model
  and group of rows, ``(2 * layers, rows, heads, capacity, head_dim)``; a
  step writes one position in place, and rows and capacity double when full;
* encoder keys and values are computed once per sentence, ``(sentences,
  heads, source, head_dim)``, and every row attends to its own sentence's
  keys without a per-row copy;
* query, key and value come from one fused projection; in float32 on the
  CPU every product runs on a weight packed once for MKL
  (:mod:`fairseq_stream.ops.prepacked_linear`: skinny products 1.3-2.6x
  faster than ``F.linear``, which packs the weight again on every call);
* each attention is one compiled call on the CPU
  (:mod:`fairseq_stream.ops.attention`: the cache write and the attention
  of every row and head over its own keys); elsewhere, torch ops over the
  cache in place (queries packed by sentence for the encoder attention);
* rows name their cache slot through an index: a reorder copies only the
  rows that a parent passes to a second child.

A state is a list of *segments*: groups of rows that were started together,
each with its own caches, encoder keys and prefix length. Joining cohorts
(the streaming pool) concatenates segment lists without copying, and one
decoder call over cohorts of different lengths (VAR-STR-FIFO) is a call over
their segments, each attending over its own length. Projections, layer norms
and the feed-forward blocks run over all rows at once.

Exactness: the arithmetic is fairseq's, in another order (fused projections,
the attention kernels, MKL's packed products in float32): in float64 the
n-best lists equal the fairseq runner's to about 1e-12 (tests/test_lean_runner.py); in float32 printed
hypotheses differ on a few sentences of a test set in a thousand
(benchmarks/bench_step.py measures it).
"""

import bisect
import math
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from fairseq_stream.ops import attention, lean_step, prepacked_linear
from fairseq_stream.runners import lean_encoder
from fairseq_stream.runners.own_step import OwnStepRunner
from fairseq_stream.runners.packing import pack_by_sentence

# Segments a state may hold before they are merged into one (each costs an
# attention call per layer and step).
MAX_SEGMENTS = 4
# The same for a state whose segments differ in length (cohorts joined across steps): only segments at
# one length can merge, and a merge copies their caches whole (18 ms at k=5 and 32 sentences, more than
# the extra attention calls of a few segments cost over their lives).
MAX_MIXED_SEGMENTS = 16
# Initial self-attention capacity in positions; it doubles when reached.
INITIAL_CAPACITY = 32
# A segment with more than twice as many cache slots as rows, and at least
# twice this many, is compacted.
COMPACT_ABOVE_SLOTS = 32


def unsupported_reason(model) -> Optional[str]:
    """Why the lean runner cannot run ``model`` (None if it can)."""
    from fairseq.models.transformer import TransformerDecoderBase
    from fairseq.modules.transformer_layer import TransformerDecoderLayerBase

    decoder = getattr(model, "decoder", None)
    name = type(model).__name__
    if not isinstance(decoder, TransformerDecoderBase):
        return "{} is not a fairseq transformer".format(name)
    if type(decoder).extract_features_scriptable is not TransformerDecoderBase.extract_features_scriptable:
        return "{}'s decoder has its own forward".format(name)
    if decoder.adaptive_softmax is not None:
        return "{} has an adaptive softmax".format(name)
    if decoder.cross_self_attention:
        return "{} uses cross-self-attention".format(name)
    if not isinstance(decoder.output_projection, torch.nn.Linear):
        return "{} has an unknown output projection".format(name)
    for layer in decoder.layers:
        if type(layer).forward is not TransformerDecoderLayerBase.forward:
            return "{}'s decoder layers have their own forward".format(name)
        if layer.encoder_attn is None:
            return "{} has a decoder without encoder attention".format(name)
        if any(getattr(layer, a, None) is not None for a in ("c_attn", "attn_ln", "ffn_layernorm", "w_resid")):
            return "{} uses NormFormer scaling".format(name)
        for attention in (layer.self_attn, layer.encoder_attn):
            if attention.bias_k is not None or attention.add_zero_attn:
                return "{} adds bias or zero attention keys".format(name)
            if getattr(attention, "use_xformers", False):
                return "{} uses xformers attention".format(name)
        if not layer.self_attn.qkv_same_dim:
            return "{} has self-attention of different key dimensions".format(name)
    return None


def _norm(module):
    """(shape, weight, bias, eps) of a LayerNorm, or None."""
    if module is None:
        return None
    return (module.normalized_shape, module.weight, module.bias, module.eps)


def _apply_norm(x, norm):
    shape, weight, bias, eps = norm
    return F.layer_norm(x, shape, weight, bias, eps)


def _joined(modules, prepack: bool) -> prepacked_linear.Linear:
    """One product for the ``nn.Linear`` modules' outputs side by side (fused projections)."""
    weight = modules[0].weight if len(modules) == 1 else torch.cat([m.weight for m in modules])
    biases = [m.bias for m in modules]
    bias = None if biases[0] is None else (biases[0] if len(modules) == 1 else torch.cat(biases))
    return prepacked_linear.linear(weight, bias, prepack)


class _Layer:
    """One decoder layer's weights, arranged for the step; products are callables (:mod:`prepacked_linear`)."""

    def __init__(self, layer, prepack: bool):
        self_attn, cross = layer.self_attn, layer.encoder_attn
        self.pre_norm = layer.normalize_before
        self.qkv = _joined([self_attn.q_proj, self_attn.k_proj, self_attn.v_proj], prepack)
        self.self_out = _joined([self_attn.out_proj], prepack)
        self.self_norm = _norm(layer.self_attn_layer_norm)
        self.scaling = self_attn.scaling
        self.cross_q = _joined([cross.q_proj], prepack)
        self.cross_kv = _joined([cross.k_proj, cross.v_proj], prepack)
        self.cross_out = _joined([cross.out_proj], prepack)
        self.cross_norm = _norm(layer.encoder_attn_layer_norm)
        self.cross_scaling = cross.scaling
        self.fc1, self.fc2 = _joined([layer.fc1], prepack), _joined([layer.fc2], prepack)
        self.activation = layer.activation_fn
        self.final_norm = _norm(layer.final_layer_norm)

    def residual(self, x: Tensor, norm, block) -> Tensor:
        """``x + block(x)`` with ``norm`` applied as fairseq places it: before ``block`` (pre-norm) or after the sum."""
        h = _apply_norm(x, norm) if self.pre_norm else x
        x = x + block(h)
        return x if self.pre_norm else _apply_norm(x, norm)

    def feed_forward(self, x: Tensor) -> Tensor:
        """The feed-forward sub-layer, with its residual and norm."""
        return self.residual(x, self.final_norm, lambda h: self.fc2(self.activation(self.fc1(h))))


class LeanModel:
    """One fairseq transformer's decoder weights, arranged for the lean step.

    With ``prepack`` (and float32 weights on the CPU) the products hold
    copies packed for MKL (:mod:`fairseq_stream.ops.prepacked_linear`), made
    here: build a new model after changing the parameters (products of 2 and
    3 rows read them, the others the copies).
    """

    def __init__(self, model, prepack: bool = True):
        decoder = model.decoder
        self.model = model
        self.embed = decoder.embed_tokens.weight
        self.embed_scale = decoder.embed_scale
        self.padding_idx = decoder.padding_idx
        self.project_in = _joined([decoder.project_in_dim], prepack) if decoder.project_in_dim is not None else None
        self.project_out = (_joined([decoder.project_out_dim], prepack)
                            if decoder.project_out_dim is not None else None)
        self.embed_norm = _norm(decoder.layernorm_embedding)
        self.final_norm = _norm(decoder.layer_norm)
        self.output = _joined([decoder.output_projection], prepack)
        self.layers = [_Layer(layer, prepack) for layer in decoder.layers]
        self.compiled = lean_step.compile_layers(self.layers)  # None: the Python step only
        first = decoder.layers[0].self_attn
        self.heads, self.head_dim, self.dim = first.num_heads, first.head_dim, first.embed_dim
        self.positions = self._position_table(decoder)
        self.encoder = None  # None: fairseq's encoder
        # Compiled for the CPU only: elsewhere its joined weights would be a copy nothing reads.
        if lean_encoder.unsupported_reason(model.encoder) is None and model.encoder.embed_tokens.weight.is_cpu:
            self.encoder = lean_encoder.LeanEncoder(model.encoder, self._position_table(model.encoder))

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
            x = _apply_norm(x, self.embed_norm)
        return x

    def logits(self, x: Tensor) -> Tensor:
        """The output layer's logits from the last decoder layer's states."""
        if self.final_norm is not None:
            x = _apply_norm(x, self.final_norm)
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
                return _EncoderKeys.concat(parts).select(order)
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
        return _EncoderKeys(keys, values, mask)

    def _encode_packed(self, src_tokens: Tensor) -> "_EncoderKeys":
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
        return _EncoderKeys(keys, values, mask)


# A CPU encoder call's fixed cost in source positions (one sentence's token through every layer):
# grouping a batch's sources by length pays where it saves more padded positions than this a group.
# Multi30k transformer, one Xeon thread: a batch of 64 in input order took 72 ms, sorted 40 ms
# (docs/BENCHMARKS.md, top-up run 4), about 37 us a padded position against ~1 ms a call.
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


def _resized(cache: Tensor, rows: int, positions: int, length: int, slot: Optional[Tensor] = None) -> Tensor:
    """``cache`` in a new tensor of ``rows`` x ``positions``; only the first ``length`` positions are kept.

    ``slot``: the slots that become rows ``0..rows-1`` (gathered in the same
    copy); None keeps the first ``rows`` slots in place.
    """
    # Not zeroed (a pass over the whole cache): free slots take part in
    # attention with whatever they hold, and their results are dropped.
    new = cache.new_empty(cache.size(0), rows, cache.size(2), positions, cache.size(4))
    if slot is not None:
        new[:, :, :, :length] = cache[:, slot, :, :length]
        return new
    n = min(rows, cache.size(1))
    new[:, :n, :, :length] = cache[:, :n, :, :length]
    return new


@dataclass
class _EncoderKeys:
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

    def select(self, sentences: Tensor) -> "_EncoderKeys":
        return _EncoderKeys(
            [k.index_select(0, sentences) for k in self.keys],
            [v.index_select(0, sentences) for v in self.values],
            self.mask.index_select(0, sentences) if self.mask is not None else None,
        )

    @staticmethod
    def concat(parts: List["_EncoderKeys"]) -> "_EncoderKeys":
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
        return _EncoderKeys(
            [torch.cat([pad(p.keys[i]) for p in parts]) for i in layers],
            [torch.cat([pad(p.values[i]) for p in parts]) for i in layers],
            mask,
        )


class _Segment:
    """Rows started together: their caches (one per model), encoder keys and prefix length."""

    def __init__(self, encoder: List[_EncoderKeys], row_sentence: Tensor, caches: List[Tensor], length: int):
        self.encoder = encoder  # per model; shared (read-only) by segments split from one another
        self.row_sentence = row_sentence  # (rows,) index into the encoder keys
        self.caches = caches  # per model (2 * layers, capacity rows, heads, capacity positions, head_dim)
        self.slot = None  # (rows,) each row's cache slot; None: row i is slot i
        self.length = length  # positions written
        self.pack = None  # (row -> packed index, widest beam), made when needed

    @property
    def rows(self):
        return self.row_sentence.numel()

    def slots(self) -> Tensor:
        """Each row's cache slot."""
        if self.slot is None:
            return torch.arange(self.rows, device=self.row_sentence.device)
        return self.slot

    def packing(self):
        """Each row's index in a ``(sentences, widest beam)`` layout, and the widest beam."""
        if self.pack is None:
            self.pack = pack_by_sentence(self.row_sentence, self.encoder[0].sentences)
        return self.pack


@dataclass
class LeanState:
    """The lean runner's state of a group of rows: segments, rows in segment order."""

    segments: List[_Segment]

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.segments)


class LeanRunner(OwnStepRunner):
    """Encode sentences, then run single-token decoder steps of fairseq transformers ourselves.

    The same interface as :class:`fairseq_stream.runner.ModelRunner`.

    Args:
        models: fairseq transformer models (an ensemble of one or more) that
            :func:`unsupported_reason` accepts.
        temperature: divides the decoder logits, as fairseq's ``--temperature``.
        prepack: float32 products on the CPU with weights packed once for MKL
            (:mod:`fairseq_stream.ops.prepacked_linear`); False keeps
            ``F.linear``'s arithmetic.
        compiled_attention: both attentions in one compiled call each on the
            CPU (:mod:`fairseq_stream.ops.attention`); False keeps their torch
            references.
        compiled_step: with the compiled attention, all layers of a step in
            one compiled call (:mod:`fairseq_stream.ops.lean_step`; the same
            results); False keeps the Python step.
        packed_encoder: on the CPU, the encoder's layers over the batch's
            tokens without padding in one compiled call
            (:mod:`fairseq_stream.runners.lean_encoder`); False keeps
            fairseq's encoder.
    """

    name = "lean"
    # A state's segments keep their own lengths: cohorts at different steps join (Cohort.merge).
    joins_lengths = True

    def __init__(self, models, temperature: float = 1.0, prepack: bool = True, compiled_attention: bool = True,
                 compiled_step: bool = True, packed_encoder: bool = True):
        super().__init__(models, temperature)
        self.prepack = prepack
        self.compiled_attention = compiled_attention
        self.compiled_step = compiled_step
        self.packed_encoder = packed_encoder
        self._build()

    def _build(self):
        self.lean = [LeanModel(m, self.prepack) for m in self.model.models]

    # -- the interface -----------------------------------------------------

    @torch.no_grad()
    def start(self, net_input, rows_per_sentence: int, sentence_ids: Optional[Tensor] = None) -> LeanState:
        """Encode ``net_input``; ``rows_per_sentence`` decoder rows per sentence, nothing decoded yet."""
        encoder = [m.encode(net_input, self.packed_encoder) for m in self.lean]
        S = net_input["src_tokens"].size(0)
        device = net_input["src_tokens"].device
        row_sentence = torch.arange(S, device=device).repeat_interleave(rows_per_sentence)
        caches = [self._new_cache(m, row_sentence.numel(), INITIAL_CAPACITY, device) for m in self.lean]
        return LeanState([_Segment(encoder, row_sentence, caches, 0)])

    @torch.no_grad()
    def step(self, state: LeanState, tokens: Tensor, logits: bool = False):
        """Run one decoder step on all rows of ``state``; ``tokens`` (rows, length) are their prefixes.

        Returns:
            (lprobs (rows, vocab), None): no attention is kept. With
            ``logits``, a list of one (rows, vocab) tensor per model (in the
            model's type, before ``--temperature``) instead of ``lprobs``.
        """
        length = tokens.size(1) - 1
        if any(s.length != length for s in state.segments):
            raise ValueError("internal: prefixes of {} tokens for a state at another length".format(length + 1))
        return self._forward(state.segments, tokens[:, -1], logits), None

    @torch.no_grad()
    def step_mixed(self, states: List[LeanState], last_tokens: Tensor, lengths: List[int], logits: bool = False):
        """One decoder call over groups whose prefixes differ in length (VAR-STR-FIFO).

        Every segment attends over its own prefix and gets its own positions;
        no state is joined or padded.
        """
        for state, length in zip(states, lengths):
            if any(s.length != length - 1 for s in state.segments):
                raise ValueError("internal: a state at another length than its group's")
        return self.step_own(states, last_tokens, logits)

    @torch.no_grad()
    def step_own(self, states: List[LeanState], last_tokens: Tensor, logits: bool = False):
        """One decoder call over ``states``, every segment at its own length (states of mixed lengths).

        ``last_tokens``: (rows, 1), the last token of every row, states in order.
        """
        return self._forward([s for st in states for s in st.segments], last_tokens.view(-1), logits), None

    def reorder(self, state: LeanState, new_order: Tensor):
        """Make row ``i`` continue old row ``new_order[i]`` (select, copy or drop rows), in place."""
        parts = self._split(state, new_order)
        kept = []
        for segment, order in parts:
            if order.numel() == 0:
                continue
            self._reorder_segment(segment, order)
            kept.append(segment)
        state.segments = kept

    def take(self, state: LeanState, rows: Tensor) -> LeanState:
        """A new state holding rows ``rows`` of ``state``; ``state`` itself is left as it was."""
        taken = []
        for segment, order in self._split(state, rows):
            if order.numel() == 0:
                continue
            slots = segment.slots().index_select(0, order)
            # Only the written positions: a cohort split when it is admitted (length 0) copied its whole
            # preallocated cache, 15 ms a split at k=5 and 64 sentences, 6% of a top-up run.
            caches = [_resized(cache, slots.numel(), cache.size(3), segment.length, slots) for cache in segment.caches]
            taken.append(self._compacted(_Segment(segment.encoder, segment.row_sentence[order],
                                                  caches, segment.length)))
        return LeanState(taken)

    def concat(self, states: List[LeanState], any_length: bool = False) -> LeanState:
        """One state holding the rows of ``states`` in order; all at the same length unless ``any_length``.

        Segments at different lengths stay apart (each attends over its own
        length); above :data:`MAX_SEGMENTS` (:data:`MAX_MIXED_SEGMENTS` for
        mixed lengths) those of equal length merge.
        """
        segments = [s for st in states for s in st.segments]
        lengths = {s.length for s in segments}
        if len(lengths) > 1 and not any_length:
            raise ValueError("joining decoder states of different steps")
        if len(lengths) == 1 and len(segments) > MAX_SEGMENTS:
            segments = [self._merge(segments)]
        elif len(segments) > MAX_MIXED_SEGMENTS:
            segments = self._merge_equal_lengths(segments)
        return LeanState(segments)

    def _merge_equal_lengths(self, segments: List[_Segment]) -> List[_Segment]:
        """Runs of neighbouring segments at one length merged (rows keep their order)."""
        runs: List[List[_Segment]] = []
        for segment in segments:
            if runs and runs[-1][0].length == segment.length:
                runs[-1].append(segment)
            else:
                runs.append([segment])
        return [run[0] if len(run) == 1 else self._merge(run) for run in runs]

    # -- internals ---------------------------------------------------------

    def _new_cache(self, lean: LeanModel, rows: int, positions: int, device):
        # Not zeroed (at k=5 and 64 sentences, 63 MB: 22 ms a batch, 3% of decoding): a row reads only
        # positions it wrote, and the torch attention's free slots, read with the others, are dropped
        # (as in _resized).
        return torch.empty(2 * len(lean.layers), rows, lean.heads, positions, lean.head_dim,
                           dtype=lean.embed.dtype, device=device)

    @staticmethod
    def _split(state: LeanState, order: Tensor):
        """``order`` (rows of the whole state) as (segment, rows of that segment) pairs.

        Our decoder keeps each sentence's rows in its segment and segments in
        order; anything else is first merged into one segment.
        """
        segments = state.segments
        if len(segments) == 1:
            return [(segments[0], order)]
        sizes = torch.tensor([s.rows for s in segments], device=order.device)
        ends = torch.cumsum(sizes, 0)
        owner = torch.bucketize(order, ends, right=True)
        if order.numel() > 1 and bool((owner[1:] < owner[:-1]).any()):
            if len({s.length for s in segments}) > 1:
                raise ValueError("internal: rows moved across segments of different lengths")
            merged = LeanRunner._merge(segments)
            state.segments = [merged]
            return [(merged, order)]
        counts = torch.bincount(owner, minlength=len(segments)).tolist()
        starts = (ends - sizes).tolist()
        parts, at = [], 0
        for segment, count, start in zip(segments, counts, starts):
            parts.append((segment, order[at: at + count] - start))
            at += count
        return parts

    @staticmethod
    def _merge(segments: List[_Segment]) -> _Segment:
        """One segment holding the rows of ``segments`` (same length), caches and encoder keys joined."""
        length = segments[0].length
        capacity = max(s.caches[0].size(3) for s in segments)
        caches = []
        for i in range(len(segments[0].caches)):
            parts = [_resized(s.caches[i], s.rows, capacity, length, s.slot) for s in segments]
            caches.append(torch.cat(parts, dim=1))
        offsets, sentence = 0, []
        for s in segments:
            sentence.append(s.row_sentence + offsets)
            offsets += s.encoder[0].sentences
        encoder = [_EncoderKeys.concat([s.encoder[i] for s in segments]) for i in range(len(segments[0].encoder))]
        return LeanRunner._compacted(_Segment(encoder, torch.cat(sentence), caches, length))

    @staticmethod
    def _compacted(segment: _Segment) -> _Segment:
        """Drop encoder keys of sentences that have no row left."""
        sentences = segment.encoder[0].sentences
        present = torch.zeros(sentences, dtype=torch.bool, device=segment.row_sentence.device)
        present[segment.row_sentence] = True
        kept = present.nonzero().flatten()
        if kept.numel() < sentences:
            segment.encoder = [e.select(kept) for e in segment.encoder]
            remap = torch.cumsum(present, 0) - 1
            segment.row_sentence = remap[segment.row_sentence]
        segment.pack = None
        return segment

    def _reorder_segment(self, segment: _Segment, order: Tensor):
        rows, length = order.numel(), segment.length
        arange = torch.arange(rows, device=order.device)
        slot = segment.slots().index_select(0, order)
        capacity = segment.caches[0].size(1)
        # A row keeps its parent's slot; a parent's second and later children
        # get free slots with a copy of its keys and values.
        first = torch.full((capacity,), rows, dtype=torch.long, device=order.device)
        first.scatter_reduce_(0, slot, arange, reduce="amin")
        children = (first.index_select(0, slot) != arange).nonzero().flatten()
        if children.numel():
            used = torch.zeros(capacity, dtype=torch.bool, device=order.device)
            used[slot] = True
            free = (~used).nonzero().flatten()
            if free.numel() < children.numel():
                grown = max(capacity + children.numel() - free.numel(), 2 * capacity)
                segment.caches = [_resized(c, grown, c.size(3), length) for c in segment.caches]
                free = torch.cat([free, torch.arange(capacity, grown, device=order.device)])
                capacity = grown
            target = free[: children.numel()]
            if length:
                source = slot.index_select(0, children)
                for cache in segment.caches:
                    cache[:, target, :, :length] = cache[:, source, :, :length]
            slot = slot.index_put((children,), target)
        if capacity >= 2 * COMPACT_ABOVE_SLOTS and 2 * rows < capacity:
            # Most slots are free (sentences ended): attention runs over every
            # slot, so gather the used ones.
            segment.caches = [c.index_select(1, slot) for c in segment.caches]
            slot = arange
        segment.slot = None if torch.equal(slot, arange) else slot
        new_sentence = segment.row_sentence.index_select(0, order)
        if not torch.equal(new_sentence, segment.row_sentence):
            segment.row_sentence = new_sentence
            segment.pack = None
            # The compiled attention reads only its rows' sentences, so keys of sentences without rows cost
            # it nothing but memory: they are dropped once they are the larger part (copies stay amortized).
            # The torch attention packs every sentence: drop them at once.
            if (not (self.compiled_attention and attention.compiled_applies(segment.encoder[0].keys[0]))
                    or 2 * segment.rows <= segment.encoder[0].sentences):
                self._compacted(segment)

    def _forward(self, segments: List[_Segment], last_tokens: Tensor, logits: bool = False):
        """One step of every model over the segments' rows; the ensemble's log-probabilities (or logits)."""
        bounds, at = [], 0
        for s in segments:
            bounds.append((at, at + s.rows))
            at += s.rows
        for s in segments:
            if s.length >= s.caches[0].size(3):
                # Grown caches keep only the rows' own slots: a long output is often one row of a batch
                # whose other slots freed up, and copying those would cost more than the step.
                s.caches = [_resized(c, s.rows, 2 * c.size(3), s.length, s.slot) for c in s.caches]
                s.slot = None
        outs = [self._model_step(i, lean, segments, bounds, last_tokens) for i, lean in enumerate(self.lean)]
        for s in segments:
            s.length += 1
        return self._ensemble(outs, logits)

    def _model_step(self, index: int, lean: LeanModel, segments, bounds, last_tokens):
        D = lean.dim
        compiled = self.compiled_attention
        position = None
        if lean.positions is not None:
            index_of = [lean.padding_idx + s.length + 1 for s in segments]
            if len(set(index_of)) == 1:
                position = index_of[0]
            else:
                position = torch.cat([torch.full((s.rows,), i, dtype=torch.long, device=last_tokens.device)
                                      for s, i in zip(segments, index_of)])
        x = lean.embed_at(last_tokens, position)
        if compiled and self.compiled_step and lean.compiled is not None and attention.compiled_applies(x):
            encoders = [s.encoder[index] for s in segments]
            x = lean_step.lean_layers(
                x, lean.compiled, [s.caches[index] for s in segments], [s.slot for s in segments],
                [s.length for s in segments], [a for a, _ in bounds] + [bounds[-1][1]], [e.keys for e in encoders],
                [e.values for e in encoders], [e.mask for e in encoders], [s.row_sentence for s in segments])
            return lean.logits(x)
        for l, layer in enumerate(lean.layers):

            def self_attention(h):
                # Write this position's key and value, attend over the prefix.
                q, k, v = layer.qkv(h).split(D, dim=-1)
                outs = [attention.cached_attention_(q[a:b], k[a:b], v[a:b], s.caches[index][2 * l],
                                                    s.caches[index][2 * l + 1], s.slot, s.length, layer.scaling,
                                                    compiled)
                        for s, (a, b) in zip(segments, bounds)]
                return layer.self_out(outs[0] if len(outs) == 1 else torch.cat(outs))

            def encoder_attention(h):
                # Every row attends over its own sentence's keys (no per-row copy).
                q = layer.cross_q(h)
                outs = []
                for s, (a, b) in zip(segments, bounds):
                    enc = s.encoder[index]
                    outs.append(attention.source_attention(
                        q[a:b], enc.keys[l], enc.values[l], enc.mask, layer.cross_scaling, s.row_sentence,
                        None if compiled else s.packing(), compiled))
                return layer.cross_out(outs[0] if len(outs) == 1 else torch.cat(outs))

            x = layer.residual(x, layer.self_norm, self_attention)
            x = layer.residual(x, layer.cross_norm, encoder_attention)
            x = layer.feed_forward(x)
        return lean.logits(x)
