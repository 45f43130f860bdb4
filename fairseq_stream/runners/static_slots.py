"""The static-slot runner: the lean step over keys and values that stay where they were written.

Issue 53, stage 2. Keys and values live in one pool per runner
(:class:`~fairseq_stream.runners.slot_pool.SlotPool`): per model, a cache of
slots at a length that doubles rarely, and the encoder's keys and values by
sentence slot, each with a pad slot. A group of rows (:class:`StaticState`)
is four device vectors, each row's key/value slot, sentence slot and length
(positions written), plus the slots it owns; so

* a step is one call over every row whatever its group and length (a
  position and a mask per row; no segments): the same ops and shapes step
  after step;
* reorder, take and concat change indices and metadata: a reorder copies
  only a parent's second and later children into the group's free slots
  (a copy list of a size the host knows), a take copies its rows into fresh
  slots, a concat joins the vectors; nothing reallocates a cache;
* with ``row_buckets`` / ``length_bucket`` the rows are padded to a bucket
  (pad rows read and write slot 0 and sentence slot 0) and the keys read
  to a multiple of ``length_bucket``: what a CUDA graph of the step needs
  (:meth:`StaticSlotRunner.forward_static` is that region; with
  :meth:`StaticSlotRunner.use_cuda_graphs` it is captured and replayed:
  :mod:`~fairseq_stream.runners.step_graphs`).

The weights and the layer loop are the lean runner's
(:class:`~fairseq_stream.runners.lean_model.LeanModel`); the attentions are
:mod:`~fairseq_stream.runners.static_attention`. Members of an ensemble of
one shape run stacked (:mod:`~fairseq_stream.runners.static_stacked`: one
pool model, one call per product), else one after another. Exactness: the
lean runner's arithmetic over a longer, masked key range; in float64 its
n-best lists equal the lean runner's (tests/test_static_slots.py).
"""

import weakref
from typing import List, Optional, Sequence

import torch
from torch import Tensor

from fairseq_stream.ops import attention
from fairseq_stream.runners import static_attention, static_stacked
from fairseq_stream.runners.buckets import bucket
from fairseq_stream.runners.lean_model import LeanModel
from fairseq_stream.runners.own_step import OwnStepRunner
from fairseq_stream.runners.slot_pool import SlotPool
from fairseq_stream.runners.static_moves import copy_slots, move_children, ordered_distinct
from fairseq_stream.runners.step_graphs import DEFAULT_LENGTH_BUCKET, DEFAULT_ROW_BUCKETS, StepGraphs

# A group with more than twice as many slots as rows, and at least this many slots, moves its rows into
# fresh slots and gives the rest back (sentences ended).
COMPACT_ABOVE_SLOTS = 64


def _numbers(values: List[int], device) -> Tensor:
    """Host numbers as a long tensor on ``device`` (a copy to the device where it is not the CPU)."""
    t = torch.tensor(values, dtype=torch.long)
    return t if device.type == "cpu" else t.to(device)


class _Holding:
    """The pool's slot and sentence numbers a group holds; given back when the group is collected."""

    def __init__(self, pool: SlotPool, slots: List[int], sentences: List[int]):
        self.pool, self.slots, self.sentences = pool, slots, sentences

    def release(self):
        with self.pool.lock:
            self.pool.slots.release(self.slots)
            self.pool.sentences.release(self.sentences)


class StaticState:
    """A group of rows of the static-slot runner: per-row vectors into the pool, and what the group owns.

    ``holding.sentences``: the group's sentence slots in row order (rows stay
    with their sentence, sentences in order); ``owned``: its key/value slots
    (at least one a row); ``longest``: no row has written more positions;
    ``uniform``: every row's length where they agree, else None.
    """

    def __init__(self, pool: SlotPool, slot: Tensor, sentence: Tensor, length: Tensor, owned: Tensor,
                 holding: _Holding, longest: int, uniform: Optional[int]):
        self.slot, self.sentence, self.length, self.owned = slot, sentence, length, owned
        self.holding = holding
        weakref.finalize(self, holding.release)
        self.longest, self.uniform = longest, uniform

    @property
    def rows(self) -> int:
        return self.slot.numel()


class StaticSlotRunner(OwnStepRunner):
    """The runner interface over static slots (see the module docstring).

    Args:
        models: fairseq transformers the lean runner accepts
            (:func:`fairseq_stream.runners.lean.unsupported_reason`).
        prepack, packed_encoder: as :class:`~fairseq_stream.runners.lean.LeanRunner`'s.
        compiled_attention: the CPU's compiled attention kernels; False
            runs their torch forms (what runs on CUDA, and what a graph
            captures).
        row_buckets: pad each step's rows up to the smallest of these sizes
            (ascending); None: no padding.
        length_bucket: attend over positions rounded up to a multiple of
            this; None: to the longest row's length.
        stack_members: an ensemble of one shape stacked
            (:func:`~fairseq_stream.runners.static_stacked.stacked_members`):
            True, False, or None (auto).
    """

    name = "static"
    joins_lengths = True
    # Reorders take each sentence's row count from the decoder and read nothing back.
    sync_free = True

    def __init__(self, models, temperature: float = 1.0, prepack: bool = True, compiled_attention: bool = True,
                 packed_encoder: bool = True, row_buckets: Optional[Sequence[int]] = None,
                 length_bucket: Optional[int] = None, stack_members: Optional[bool] = None):
        super().__init__(models, temperature)
        self.stack_members = stack_members
        self.prepack, self.compiled_attention, self.packed_encoder = prepack, compiled_attention, packed_encoder
        self.row_buckets = sorted(row_buckets) if row_buckets else None
        self.length_bucket = length_bucket
        self.reserved_rows_bucket = False  # reserve adds its rows to the row buckets (default_buckets)
        self.graphs: Optional[StepGraphs] = None  # the captured step (use_cuda_graphs), None: eager
        self._build()

    def default_buckets(self):
        """Rows and key positions in buckets, the defaults where none are set; with the default row buckets,
        the most rows a decode's step runs (:meth:`reserve`'s ``rows``) is a bucket too: a batch of 64 at
        k=5 steps 320 rows, which the powers of two would pad to 512, 60% more products a step."""
        self.reserved_rows_bucket = not self.row_buckets
        self.row_buckets = self.row_buckets or list(DEFAULT_ROW_BUCKETS)
        self.length_bucket = self.length_bucket or DEFAULT_LENGTH_BUCKET

    def use_cuda_graphs(self):
        """Capture and replay the step (CUDA; :mod:`~fairseq_stream.runners.step_graphs`): the torch attention,
        rows and key positions in buckets (:meth:`default_buckets`)."""
        self.compiled_attention = False
        self.default_buckets()
        self.graphs = StepGraphs(self.forward_static)

    def reserve_positions(self, n: int):
        """Room for rows of ``n`` positions from now on: a captured step's pool then keeps its shape for the
        decode (growth drops the graphs). Eager steps grow the pool as they go."""
        if self.graphs is not None:
            with self.pool.lock:
                self.pool.fit_positions(self._positions(n))

    def reserve(self, rows: int, sentences: int, positions: int, source: int = 0):
        """The pool sized once for a decode, at its start: ``rows`` rows in ``sentences`` sentences, of up to
        ``positions`` positions (rounded up to the length bucket), sources up to ``source`` tokens (0: the
        first batch's, doubling past it), so that it does not grow while it steps
        (a growth drops the captured graphs). A group gives back the slots its ended rows freed only once it
        holds more than twice its rows and at least ``COMPACT_ABOVE_SLOTS`` (:meth:`_compact`): so twice the
        rows, and that many more for groups below the threshold (a bound the toy streams' tests check; past it
        the pool still doubles, recorded in its ``growths``)."""
        self.pool.reserve(2 * rows + COMPACT_ABOVE_SLOTS, sentences, self._positions(positions), source)
        if self.reserved_rows_bucket and rows not in self.row_buckets:
            self.row_buckets = sorted(self.row_buckets + [rows])

    def _build(self):
        from fairseq_stream.runners.base import module_device

        self.lean = [LeanModel(m, self.prepack) for m in self.model.models]
        self.device = module_device(self.model)
        # The pool's models: the stacked model alone, or each member.
        self.stacked, self.unstacked_reason = static_stacked.stacked_members(self.lean, self.stack_members,
                                                                              self.compiled_attention)
        models = [self.stacked] if self.stacked is not None else self.lean
        self.pool = SlotPool(models, self.device, self.lean[0].embed.dtype)

    # -- the interface -----------------------------------------------------

    @torch.no_grad()
    def start(self, net_input, rows_per_sentence: int, sentence_ids: Optional[Tensor] = None) -> StaticState:
        """Encode ``net_input`` into sentence slots; ``rows_per_sentence`` rows each, in fresh key/value slots."""
        encoders = [m.encode(net_input, self.packed_encoder) for m in self.pool.models]
        S = net_input["src_tokens"].size(0)
        pool = self.pool
        with pool.lock:
            sentences = pool.add_sentences(encoders)
            slots = pool.take_slots(S * rows_per_sentence)
        owned = _numbers(slots, self.device)
        sentence = _numbers(sentences, self.device).repeat_interleave(rows_per_sentence)
        length = torch.zeros(owned.numel(), dtype=torch.long, device=self.device)
        return StaticState(pool, owned, sentence, length, owned, _Holding(pool, slots, sentences), 0, 0)

    @torch.no_grad()
    def step(self, state: StaticState, tokens: Tensor, logits: bool = False):
        """One decoder step of every row; ``tokens`` (rows, length) are their prefixes. (lprobs or logits, None)."""
        if state.uniform is not None and state.uniform != tokens.size(1) - 1:
            raise ValueError("internal: prefixes of {} tokens for a state at another length".format(tokens.size(1)))
        return self._forward([state], tokens[:, -1], logits), None

    @torch.no_grad()
    def step_mixed(self, states: List[StaticState], last_tokens: Tensor, lengths: List[int], logits: bool = False):
        """One decoder call over groups at different lengths (VAR-STR-FIFO); every row has its own length."""
        for state, length in zip(states, lengths):
            if state.uniform is not None and state.uniform != length - 1:
                raise ValueError("internal: a state at another length than its group's")
        return self.step_own(states, last_tokens, logits)

    @torch.no_grad()
    def step_own(self, states: List[StaticState], last_tokens: Tensor, logits: bool = False):
        """One decoder call over ``states``, every row at its own length; ``last_tokens`` (rows, 1)."""
        return self._forward(states, last_tokens.view(-1), logits), None

    @torch.no_grad()
    def reorder(self, state: StaticState, new_order: Tensor, sentence_rows: Optional[List[int]] = None):
        """Row ``i`` continues old row ``new_order[i]``, in place; ``sentence_rows``: each sentence's new rows.

        Without ``sentence_rows`` (or where they do not match the group's
        sentences) they are counted from the device.
        """
        holding, pool = state.holding, self.pool
        if sentence_rows is None or len(sentence_rows) != len(holding.sentences):
            sentence_rows = self._count_rows(state, new_order)
        rows = new_order.numel()
        with pool.lock:
            if rows > state.owned.numel():
                self._own_more(state, max(rows, 2 * state.owned.numel()) - state.owned.numel())
            slot = state.slot.index_select(0, new_order)
            moved = rows - sum(1 for c in sentence_rows if c)
            if moved > 0:
                slot, source, target = move_children(slot, state.owned, pool.slots.capacity, moved)
                self._copy(source, target, state.longest)
            state.slot = slot
            state.sentence = state.sentence.index_select(0, new_order)
            state.length = state.length.index_select(0, new_order)
            gone = [s for s, c in zip(holding.sentences, sentence_rows) if not c]
            if gone:
                holding.sentences = [s for s, c in zip(holding.sentences, sentence_rows) if c]
                pool.sentences.release(gone)
            if state.owned.numel() >= COMPACT_ABOVE_SLOTS and 2 * rows < state.owned.numel():
                self._compact(state)

    @torch.no_grad()
    def take(self, state: StaticState, rows: Tensor) -> StaticState:
        """A new group of rows ``rows`` of ``state``, copied into fresh slots; ``state`` is left as it was."""
        pool = self.pool
        with pool.lock:
            slots = pool.take_slots(rows.numel())
            owned = _numbers(slots, self.device)
            self._copy(state.slot.index_select(0, rows), owned, state.longest)
            sentence = state.sentence.index_select(0, rows)
            sentences = ordered_distinct(sentence.tolist())  # a split: the scheduler's, not a step's
            pool.sentences.retain(sentences)
        return StaticState(pool, owned, sentence, state.length.index_select(0, rows), owned,
                           _Holding(pool, slots, sentences), state.longest, state.uniform)

    @torch.no_grad()
    def concat(self, states: List[StaticState], any_length: bool = False) -> StaticState:
        """One group of the rows of ``states`` in order (sharing their slots); one length unless ``any_length``."""
        uniform = {s.uniform for s in states}
        if not any_length and None not in uniform and len(uniform) > 1:
            raise ValueError("joining decoder states of different steps")
        slots = [i for s in states for i in s.holding.slots]
        sentences = [i for s in states for i in s.holding.sentences]
        pool = self.pool
        with pool.lock:
            pool.slots.retain(slots)
            pool.sentences.retain(sentences)

        def joined(name):
            return torch.cat([getattr(s, name) for s in states])

        return StaticState(pool, joined("slot"), joined("sentence"), joined("length"), joined("owned"),
                           _Holding(pool, slots, sentences), max(s.longest for s in states),
                           uniform.pop() if len(uniform) == 1 else None)

    # -- internals ---------------------------------------------------------

    def _count_rows(self, state: StaticState, order: Tensor) -> List[int]:
        """Each of the group's sentences' rows after ``order``, read from the device; the sentence list
        rebuilt from the rows where it does not match."""
        new = state.sentence.index_select(0, order).tolist()
        counts = {}
        for s in new:
            counts[s] = counts.get(s, 0) + 1
        known = state.holding.sentences
        if set(counts) - set(known):
            raise ValueError("internal: rows moved to sentences the group does not hold")
        return [counts.get(s, 0) for s in known]

    def _own_more(self, state: StaticState, n: int):
        extra = self.pool.take_slots(n)
        state.holding.slots = state.holding.slots + extra
        state.owned = torch.cat([state.owned, _numbers(extra, self.device)])

    def _compact(self, state: StaticState):
        """The rows moved to fresh slots, one each; the group's old slots given back."""
        pool, holding = self.pool, state.holding
        slots = pool.take_slots(state.rows)
        fresh = _numbers(slots, self.device)
        self._copy(state.slot, fresh, state.longest)
        pool.slots.release(holding.slots)
        holding.slots, state.owned, state.slot = slots, fresh, fresh

    def _positions(self, n: int) -> int:
        """``n`` positions rounded up to the length bucket (a fixed shape for a span of steps)."""
        return -(-n // self.length_bucket) * self.length_bucket if self.length_bucket and n else n

    def _copy(self, source: Tensor, target: Tensor, written: int):
        """Keys and values of ``source`` slots copied to ``target`` slots, every model, up to the written
        positions: exactly those by a compiled copy (the CPU's, with the compiled attention; CUDA's kernel
        always), else by torch's indexed copy rounded up to the length bucket (its ATen calls' shapes then
        stay fixed between steps: tests/test_static_graph_trace.py)."""
        compiled = self._copies_in_place()
        positions = min(written if compiled else self._positions(written), self.pool.positions)
        copy_slots(self.pool.caches, source, target, positions, compiled)

    def _copies_in_place(self) -> bool:
        """Whether :meth:`_copy` takes the compiled copy (see there)."""
        cache = self.pool.caches[0]
        return attention.copies_slots_in_place(cache) and (self.compiled_attention or cache.is_cuda)

    def _forward(self, states: List[StaticState], last_tokens: Tensor, logits: bool):
        """One step of every row of ``states``: inputs padded to their bucket, the static region, lengths moved on."""
        def joined(name):
            parts = [getattr(s, name) for s in states]
            return parts[0] if len(parts) == 1 else torch.cat(parts)

        slot, sentence, length = joined("slot"), joined("sentence"), joined("length")
        rows, longest = slot.numel(), max(s.longest for s in states)
        positions = self._positions(longest + 1)
        tokens = last_tokens
        if self.row_buckets:
            extra = bucket(rows, self.row_buckets) - rows
            if extra:
                zeros = slot.new_zeros(extra)
                slot, sentence, length = torch.cat([slot, zeros]), torch.cat([sentence, zeros]), \
                    torch.cat([length, zeros])
                tokens = torch.cat([tokens, tokens.new_full((extra,), self.lean[0].padding_idx)])
        with self.pool.lock:
            self.pool.fit_positions(positions)
            if self.graphs is None:
                outs = self.forward_static(tokens, slot, sentence, length, positions)
            else:
                outs = self.graphs.run(tokens, slot, sentence, length, positions, self.pool)
        if slot.numel() != rows:
            outs = [o[:rows] for o in outs]
        for s in states:
            s.length.add_(1)
            s.longest += 1
            s.uniform = None if s.uniform is None else s.uniform + 1
        return self._ensemble(outs, logits)

    def forward_static(self, tokens: Tensor, slot: Tensor, sentence: Tensor, length: Tensor,
                       positions: int) -> List[Tensor]:
        """Each model's logits for rows at (``slot``, ``sentence``, ``length``) given their last ``tokens``.

        The region a CUDA graph would capture: every shape is the rows' and
        ``positions``' (a bucket's), nothing is read back; keys and values
        are written into the pool in place.
        """
        pool, compiled = self.pool, self.compiled_attention
        if self.stacked is not None:
            return static_stacked.forward_static(self.stacked, pool, tokens, slot, sentence, length, positions,
                                                 compiled)
        outs = []
        for i, lean in enumerate(self.lean):
            D, cache = lean.dim, pool.caches[i]
            keys, values, mask = pool.keys[i], pool.values[i], pool.masks[i]
            where = None if lean.positions is None else length + (lean.padding_idx + 1)
            x = lean.embed_at(tokens, where)

            def self_attention(l, layer, h, cache=cache):
                q, k, v = layer.qkv(h).split(D, dim=-1)
                return layer.self_out(static_attention.self_attention(
                    q, k, v, cache[2 * l], cache[2 * l + 1], slot, length, positions, layer.scaling, compiled))

            def encoder_attention(l, layer, h, keys=keys, values=values, mask=mask):
                return layer.cross_out(static_attention.source_attention(
                    layer.cross_q(h), keys[l], values[l], mask, layer.cross_scaling, sentence, compiled))

            outs.append(lean.logits(lean.run_layers(x, self_attention, encoder_attention)))
        return outs
