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
  (:mod:`fairseq_stream.ops.product`: skinny products 1.3-2.6x
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

from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import Tensor

from fairseq_stream.errors import FairseqStreamError
from fairseq_stream.ops import attention, lean_step
from fairseq_stream.ops.packing import compact, pack_by_sentence
from fairseq_stream.runners import stacked
from fairseq_stream.runners.lean_model import EncoderKeys, LeanModel
from fairseq_stream.runners.own_step import OwnStepRunner

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


def check_quantizable(model):
    """Refuse, in one line, quantized products on models that are not float32 on the CPU."""
    from fairseq_stream.runners.base import module_device, module_dtype

    dtype, device = module_dtype(model), module_device(model)
    if any(p.numel() == 0 for p in model.parameters()):
        raise FairseqStreamError("these models' float weights were released by an earlier --quantize decoder; "
                                 "load them again to build another")
    if dtype != torch.float32 or device.type != "cpu":
        raise FairseqStreamError("--quantize runs float32 models on the CPU (add --cpu, drop --fp16/--bf16); "
                                 "these are {} on {}".format(str(dtype).replace("torch.", ""), device.type))


def quantized_modules(model, lean, lean_encoder: bool = True):
    """The ``nn.Linear`` modules of ``model`` whose weights only ``lean``'s quantized products read.

    The encoder's count only where the lean encoder runs (``lean_encoder``:
    the runner's ``packed_encoder``, and the encoder compiled); elsewhere
    fairseq's encoder reads them.
    """
    decoder = model.decoder
    modules = [decoder.project_in_dim, decoder.project_out_dim]
    if decoder.output_projection.weight.data_ptr() != decoder.embed_tokens.weight.data_ptr():
        modules.append(decoder.output_projection)
    layers = list(decoder.layers)
    if lean_encoder and lean.encoder is not None and lean.encoder.compiled is not None:
        layers += [model.encoder.layers[i] for i in range(len(model.encoder.layers))]
    for layer in layers:
        attentions = [layer.self_attn] + ([layer.encoder_attn] if getattr(layer, "encoder_attn", None) else [])
        modules += [a.q_proj for a in attentions] + [a.k_proj for a in attentions] + [a.v_proj for a in attentions]
        modules += [a.out_proj for a in attentions] + [layer.fc1, layer.fc2]
    return [m for m in modules if m is not None and m.weight.numel()]


def free_float_weights(models, lean: List[LeanModel], lean_encoder: bool) -> int:
    """Free the float weights of ``models`` that only ``lean``'s quantized products read; the bytes freed.

    Every projection of the decoder's layers (and of the encoder's, where
    the lean encoder runs it) has its own quantized copy, so the model's
    float matrices are dead weight: for a WMT'19 transformer-big, about
    1 GB of each model's 1.28. What stays in float: the embeddings (the
    output projection too where it shares them), positions, layer norms
    and biases. The models cannot run float products afterwards: call it
    only where the runner owns them (:func:`fairseq_stream.build.build_decoder`).
    """
    freed = 0
    for model, own in zip(models, lean):
        for module in quantized_modules(model, own, lean_encoder):
            freed += module.weight.numel() * module.weight.element_size()
            module.weight.data = module.weight.data.new_empty(0)
    return freed


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


class _Segment:
    """Rows started together: their caches (one per model), encoder keys and prefix length."""

    def __init__(self, encoder: List[EncoderKeys], row_sentence: Tensor, caches: List[Tensor], length: int):
        self.encoder = encoder  # per model; shared (read-only) by segments split from one another
        self.row_sentence = row_sentence  # (rows,) index into the encoder keys
        self.caches = caches  # per model (2 * layers, capacity rows, heads, capacity positions, head_dim)
        self.slot = None  # (rows,) each row's cache slot; None: row i is slot i
        self.length = length  # positions written
        self.pack = None  # (row -> packed index, widest beam), made when needed
        # Where the host knows them: each sentence's rows, in order (None: read when packing), and how many
        # sentences have rows (all of them have encoder keys).
        self.counts: Optional[List[int]] = None
        self.present: Optional[int] = None

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
            widest = None if self.counts is None else max(self.counts, default=1)
            self.pack = pack_by_sentence(self.row_sentence, self.encoder[0].sentences, widest)
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

    The same interface as :class:`fairseq_stream.runners.fairseq_runner.ModelRunner`.

    Args:
        models: fairseq transformer models (an ensemble of one or more) that
            :func:`unsupported_reason` accepts.
        temperature: divides the decoder logits, as fairseq's ``--temperature``.
        prepack: float32 products on the CPU with weights packed once for MKL
            (:mod:`fairseq_stream.ops.product`); False keeps
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
        quantize: "int8" (int8w8, int8w7) or "int16": every product of the decoder and the
            encoder on weights quantized once at load
            (:mod:`fairseq_stream.ops.quantized_linear`); float32 models on
            the CPU only. None: float products.
        stack_members: True: an ensemble whose members share a shape runs as
            one stacked model (:mod:`fairseq_stream.runners.stacked`: each
            product once for all members, one cache); members of different
            shapes keep the member-by-member step (one log line). False: member
            by member. None (auto): stacked where the members' step would
            not be compiled (CUDA, no extension); on the CPU each member's
            compiled step runs, measured faster than one stacked step there
            (docs/ensemble.md).
    """

    name = "lean"
    # A state's segments keep their own lengths: cohorts at different steps join (Cohort.merge).
    joins_lengths = True

    def __init__(self, models, temperature: float = 1.0, prepack: bool = True, compiled_attention: bool = True,
                 compiled_step: bool = True, packed_encoder: bool = True, quantize: Optional[str] = None,
                 stack_members: Optional[bool] = None):
        super().__init__(models, temperature)
        self.stack_members = stack_members
        self.prepack = prepack
        self.compiled_attention = compiled_attention
        self.compiled_step = compiled_step
        self.packed_encoder = packed_encoder
        self.quantize = quantize
        self._sync_free: Optional[bool] = None
        self._build()

    def _build(self):
        from fairseq_stream.runners.base import module_device

        if self.quantize is not None:
            check_quantizable(self.model)
        self.lean = [LeanModel(m, self.prepack, self.quantize) for m in self.model.models]
        # self.stacked: a StackedModel (every segment holds one stacked cache and encoder keys) or None;
        # unstacked_reason: why not ("" where stacked), which build_runner logs.
        self.stacked, self.unstacked_reason = stacked.choose(self.lean, self.stack_members, self._auto_declined(),
                                                             self.quantize)
        self.device = module_device(self.model)

    def _auto_declined(self) -> str:
        """Why ``--stack-members auto`` keeps the members apart ("" where it stacks): on the CPU."""
        first = self.lean[0]
        compiled = (self.compiled_attention and self.compiled_step and attention.compiled_applies(first.embed)
                    and all(m.compiled is not None for m in self.lean))
        return "auto: each member's compiled step is faster on the CPU (--stack-members on stacks them)" \
            if compiled else ""

    def _state_models(self):
        """What a segment holds a cache and encoder keys of: the stacked model, or each member."""
        return [self.stacked] if self.stacked is not None else self.lean

    @property
    def sync_free(self) -> bool:
        """Whether a reorder given each sentence's rows (``reorder(..., sentence_rows)``) reads nothing back.

        Then it moves rows by fixed-size index arithmetic (free slots by
        cumulative sums, a copy list padded to a size the host knows, ``slot``
        kept a tensor) instead of ``nonzero`` and ``torch.equal``, and splits
        segments and drops encoder keys by the host's counts. Default: where
        the models are off the CPU, where each read waits for the device; on
        the CPU a read costs nothing and the reading path copies fewer cache
        slots. Settable: the tests run it on the CPU.
        """
        return self.device.type != "cpu" if self._sync_free is None else self._sync_free

    @sync_free.setter
    def sync_free(self, value: Optional[bool]):
        self._sync_free = value

    # -- the interface -----------------------------------------------------

    @torch.no_grad()
    def start(self, net_input, rows_per_sentence: int, sentence_ids: Optional[Tensor] = None) -> LeanState:
        """Encode ``net_input``; ``rows_per_sentence`` decoder rows per sentence, nothing decoded yet."""
        encoder = [m.encode(net_input, self.packed_encoder) for m in self._state_models()]
        S = net_input["src_tokens"].size(0)
        device = net_input["src_tokens"].device
        row_sentence = torch.arange(S, device=device).repeat_interleave(rows_per_sentence)
        caches = [m.new_cache(row_sentence.numel(), INITIAL_CAPACITY, device) for m in self._state_models()]
        segment = _Segment(encoder, row_sentence, caches, 0)
        segment.counts, segment.present = [rows_per_sentence] * S, S
        return LeanState([segment])

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

    def compiled_loop_inputs(self, net_input):
        """What the compiled search loop (:mod:`fairseq_stream.compiled_search`) needs of these models for
        ``net_input``: (each model's loop weights, each one's encoder keys), or None where the loop does not
        apply (the Python step's paths)."""
        if not (self.compiled_step and self.compiled_attention) or any(m.search_loop is None for m in self.lean):
            return None
        encoders = [m.encode(net_input, self.packed_encoder) for m in self.lean]
        if not attention.compiled_applies(encoders[0].keys[0]):
            return None
        return [m.search_loop for m in self.lean], encoders

    def release_float_weights(self) -> int:
        """Free the float weights that only quantized products read (``--quantize``; :func:`free_float_weights`);
        the bytes freed (0 for float products)."""
        if self.quantize is None:
            return 0
        return free_float_weights(self.model.models, self.lean, self.packed_encoder)

    def reorder(self, state: LeanState, new_order: Tensor, sentence_rows: Optional[List[int]] = None):
        """Make row ``i`` continue old row ``new_order[i]`` (select, copy or drop rows), in place.

        ``sentence_rows``: how many of the new rows each sentence of the old
        rows holds (0: it ended), in order, as the caller knows them on the
        host; rows stay with their sentence and sentences keep their order
        (as the decoder's do). With :attr:`sync_free` the move then reads
        nothing back from the device.
        """
        known = _split_known(state, new_order, sentence_rows) if self.sync_free else None
        if known is not None:
            state.segments = [segment for segment, order, rows in known if rows]
            for segment, order, rows in known:
                if rows:
                    _reorder_known(segment, order, rows, self.compiled_attention)
            return
        parts = _split(state, new_order)
        kept = []
        for segment, order in parts:
            if order.numel() == 0:
                continue
            _reorder_segment(segment, order, self.compiled_attention)
            kept.append(segment)
        state.segments = kept

    def take(self, state: LeanState, rows: Tensor) -> LeanState:
        """A new state holding rows ``rows`` of ``state``; ``state`` itself is left as it was."""
        taken = []
        for segment, order in _split(state, rows):
            if order.numel() == 0:
                continue
            slots = segment.slots().index_select(0, order)
            # Only the written positions: a cohort split when it is admitted (length 0) copied its whole
            # preallocated cache, 15 ms a split at k=5 and 64 sentences, 6% of a top-up run.
            caches = [_resized(cache, slots.numel(), cache.size(3), segment.length, slots) for cache in segment.caches]
            taken.append(_compacted(_Segment(segment.encoder, segment.row_sentence[order], caches, segment.length)))
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
            segments = [_merge(segments)]
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
        return [run[0] if len(run) == 1 else _merge(run) for run in runs]

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
        if self.stacked is not None:
            outs = stacked.step(self.stacked, segments, bounds, last_tokens,
                                _position(self.lean[0], segments, last_tokens.device), self.compiled_attention)
        else:
            outs = [self._model_step(i, lean, segments, bounds, last_tokens) for i, lean in enumerate(self.lean)]
        for s in segments:
            s.length += 1
        return self._ensemble(outs, logits)

    def _model_step(self, index: int, lean: LeanModel, segments, bounds, last_tokens):
        D = lean.dim
        compiled = self.compiled_attention
        x = lean.embed_at(last_tokens, _position(lean, segments, last_tokens.device))
        if compiled and self.compiled_step and lean.compiled is not None and attention.compiled_applies(x):
            encoders = [s.encoder[index] for s in segments]
            x = lean_step.lean_layers(
                x, lean.compiled, [s.caches[index] for s in segments], [s.slot for s in segments],
                [s.length for s in segments], [a for a, _ in bounds] + [bounds[-1][1]], [e.keys for e in encoders],
                [e.values for e in encoders], [e.mask for e in encoders], [s.row_sentence for s in segments])
            return lean.logits(x)
        def self_attention(l, layer, h):
            # Write this position's key and value, attend over the prefix.
            q, k, v = layer.qkv(h).split(D, dim=-1)
            outs = [attention.cached_attention_(q[a:b], k[a:b], v[a:b], s.caches[index][2 * l],
                                                s.caches[index][2 * l + 1], s.slot, s.length, layer.scaling, compiled)
                    for s, (a, b) in zip(segments, bounds)]
            return layer.self_out(outs[0] if len(outs) == 1 else torch.cat(outs))

        def encoder_attention(l, layer, h):
            # Every row attends over its own sentence's keys (no per-row copy).
            q = layer.cross_q(h)
            outs = []
            for s, (a, b) in zip(segments, bounds):
                enc = s.encoder[index]
                outs.append(attention.source_attention(
                    q[a:b], enc.keys[l], enc.values[l], enc.mask, layer.cross_scaling, s.row_sentence,
                    None if compiled else s.packing(), compiled))
            return layer.cross_out(outs[0] if len(outs) == 1 else torch.cat(outs))

        x = lean.run_layers(x, self_attention, encoder_attention)
        return lean.logits(x)


# The segments' bookkeeping (split, merge, compact, reorder): functions of segments, which read no runner state
# but the flag passed in. They stay in this file: tests/test_host_sync.py tells the step's host reads by it.


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
        merged = _merge(segments)
        state.segments = [merged]
        return [(merged, order)]
    counts = torch.bincount(owner, minlength=len(segments)).tolist()
    starts = (ends - sizes).tolist()
    parts, at = [], 0
    for segment, count, start in zip(segments, counts, starts):
        parts.append((segment, order[at: at + count] - start))
        at += count
    return parts


def _split_known(state: LeanState, order: Tensor, sentence_rows: Optional[List[int]]):
    """``order`` as (segment, its rows of it, its sentences' row counts without the ended ones) triples, from
    the host's counts (no read of the device); None where a segment's sentences are not known there."""
    segments = state.segments
    if sentence_rows is None or any(s.present is None for s in segments) or \
            sum(s.present for s in segments) != len(sentence_rows):
        return None
    if sum(sentence_rows) != order.numel():
        raise ValueError("internal: {} rows counted by sentence for {} new rows".format(sum(sentence_rows),
                                                                                      order.numel()))
    parts, at, first_row, first_sentence = [], 0, 0, 0
    for segment in segments:
        counts = sentence_rows[first_sentence: first_sentence + segment.present]
        n = sum(counts)
        own = order[at: at + n]
        parts.append((segment, own - first_row if first_row else own, [c for c in counts if c]))
        at, first_row, first_sentence = at + n, first_row + segment.rows, first_sentence + segment.present
    return parts


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
    encoder = [EncoderKeys.concat([s.encoder[i] for s in segments]) for i in range(len(segments[0].encoder))]
    return _compacted(_Segment(encoder, torch.cat(sentence), caches, length))


def _compacted(segment: _Segment, present_count: Optional[int] = None) -> _Segment:
    """Drop encoder keys of sentences that have no row left (``present_count``: how many have rows, if
    the host knows it: then nothing is read back)."""
    sentences = segment.encoder[0].sentences
    present = torch.zeros(sentences, dtype=torch.bool, device=segment.row_sentence.device)
    present.index_fill_(0, segment.row_sentence, True)
    if present_count is None:
        kept = present.nonzero().flatten()
    else:
        kept = compact(present, present_count)
    segment.present = kept.numel()
    if kept.numel() < sentences:
        segment.encoder = [e.select(kept) for e in segment.encoder]
        remap = torch.cumsum(present, 0) - 1
        segment.row_sentence = remap[segment.row_sentence]
    segment.pack = None
    return segment


def _parent_slots(segment: _Segment, order: Tensor):
    """(arange, the slot of each new row's parent, the slots' capacity) for rows continuing rows ``order``; the
    caches grown first where the rows outnumber the slots (children take free slots, so there must be one a row)."""
    rows = order.numel()
    arange = torch.arange(rows, device=order.device)
    slot = segment.slots().index_select(0, order)
    capacity = segment.caches[0].size(1)
    if rows > capacity:
        capacity = max(rows, 2 * capacity)
        segment.caches = [_resized(c, capacity, c.size(3), segment.length) for c in segment.caches]
    return arange, slot, capacity


def _reorder_segment(segment: _Segment, order: Tensor, compiled_attention: bool):
    """Make the segment's row ``i`` continue its row ``order[i]``, in place (:meth:`LeanRunner.reorder`)."""
    arange, slot, _ = _parent_slots(segment, order)
    # The slots rows take, the copies and the compaction: on the CPU the compiled search loop's own function.
    segment.caches, slot = attention.follow_parents_(segment.caches, slot, segment.length, COMPACT_ABOVE_SLOTS,
                                                     compiled_attention)
    segment.slot = None if torch.equal(slot, arange) else slot
    new_sentence = segment.row_sentence.index_select(0, order)
    if not torch.equal(new_sentence, segment.row_sentence):
        segment.row_sentence = new_sentence
        segment.pack = None
        # The compiled attention reads only its rows' sentences, so keys of sentences without rows cost
        # it nothing but memory: they are dropped once they are the larger part (copies stay amortized).
        # The torch attention packs every sentence: drop them at once.
        segment.counts = segment.present = None
        if _drops_keys_at_once(segment, compiled_attention):
            _compacted(segment)


def _reorder_known(segment: _Segment, order: Tensor, sentence_rows: List[int], compiled_attention: bool):
    """:meth:`_reorder_segment` without a read of the device: the same slots, copies and compactions, sized
    from ``sentence_rows`` (the host's count of each sentence's new rows)."""
    rows = order.numel()
    arange, slot, capacity = _parent_slots(segment, order)
    # Each sentence's first row keeps its parent's slot: at most this many rows are children.
    moved = rows - len(sentence_rows)
    if moved > 0:
        slot = _move_children(segment, slot, arange, capacity, moved)
    if capacity >= 2 * COMPACT_ABOVE_SLOTS and 2 * rows < capacity:
        segment.caches = [c.index_select(1, slot) for c in segment.caches]
        slot = arange
    segment.slot = slot  # a tensor even where it is the identity: telling would read the device
    # Rows stay with their sentence, in order: the same counts are the same rows' sentences.
    if sentence_rows != segment.counts:
        segment.row_sentence = segment.row_sentence.index_select(0, order)
        segment.pack = None
    segment.counts, segment.present = sentence_rows, len(sentence_rows)
    if len(sentence_rows) < segment.encoder[0].sentences and _drops_keys_at_once(segment, compiled_attention):
        _compacted(segment, len(sentence_rows))


def _move_children(segment: _Segment, slot: Tensor, arange: Tensor, capacity: int, moved: int) -> Tensor:
    """Each row's new slot: a parent's first child keeps the parent's, a later one takes the next free slot
    (lowest first) with a copy of the parent's keys and values; at most ``moved`` rows are later children."""
    rows, device = arange.numel(), slot.device
    first = torch.full((capacity,), rows, dtype=torch.long, device=device)
    first.scatter_reduce_(0, slot, arange, reduce="amin")
    child = first.index_select(0, slot).ne(arange)
    free = torch.ones(capacity, dtype=torch.bool, device=device).index_fill_(0, slot, False)
    # free_slot[r]: the r-th free slot (entries past the free slots are never read).
    free_slot = torch.zeros(capacity + 1, dtype=torch.long, device=device).scatter_(
        0, torch.where(free, torch.cumsum(free, 0) - 1, capacity), torch.arange(capacity, device=device))
    child_rank = torch.cumsum(child, 0) - 1
    new_slot = torch.where(child, free_slot.index_select(0, child_rank.clamp(min=0)), slot)
    if segment.length:
        # The copy list, padded to `moved` entries: entry r copies the r-th child's parent slot to its new
        # slot; the entries past the children copy row 0's slot onto itself (row 0 is never a child).
        at = torch.where(child, child_rank, moved)
        source = slot[:1].repeat(moved + 1).scatter_(0, at, slot)[:moved]
        target = slot[:1].repeat(moved + 1).scatter_(0, at, new_slot)[:moved]
        for cache in segment.caches:
            attention.copy_slots_(cache, source, target, segment.length)
    return new_slot


def _drops_keys_at_once(segment: _Segment, compiled_attention: bool) -> bool:
    """Whether a reorder drops the encoder keys of sentences left without rows (see _reorder_segment)."""
    return (not (compiled_attention and attention.compiled_applies(segment.encoder[0].keys[0]))
            or 2 * segment.rows <= segment.encoder[0].sentences)


def _position(lean: LeanModel, segments: List[_Segment], device):
    """The position table's index of each segment's next token: one int where all agree, else one per row
    (None for a model without positions)."""
    if lean.positions is None:
        return None
    index_of = [lean.padding_idx + s.length + 1 for s in segments]
    if len(set(index_of)) == 1:
        return index_of[0]
    return torch.cat([torch.full((s.rows,), i, dtype=torch.long, device=device) for s, i in zip(segments, index_of)])
