"""The static-slot runner's memory: key/value slots and sentence slots, allocated once and reused.

A :class:`SlotPool` holds, per model, one self-attention cache ``(2 * layers,
slots, heads, positions, head_dim)`` and one set of encoder keys and values
by sentence slot ``(sentence slots, heads, source, head_dim)`` with an
additive mask ``(sentence slots, 1, 1, source)``. Rows name their key/value
slot and their sentence slot by index, so moving rows between groups moves
indices, not tensors. Slot 0 of each is the *pad slot*: rows padded up to a
bucket (:mod:`fairseq_stream.runners.static_slots`) write and read there, and
nothing else does; its encoder mask stays 0 so that a padded row's softmax
has something finite to weigh.

Slot numbers are handed out on the host (:class:`SlotNumbers`: a free list
with reference counts, since joined groups share slots until the parts are
collected). A decode sizes its pool once at its start (:meth:`SlotPool.reserve`,
from what its scheduler can admit): a captured step holds the pool's tensors,
so a pool that grows later makes the graphs be captured again. On CUDA the
reservation takes at most :data:`RESERVE_SHARE` of the device's free memory
(a WMT'19 ensemble's scheduler can hold more rows than a GPU has room for:
the ``gpu32gb-k5`` preset's 64 sentences a batch, read ahead, are several
times the 24 GB its caches were sized for); past that it reserves less,
says so in one line, and grows as the decode needs. A pool that
runs out all the same doubles: a new tensor, the old slots copied (numbers
keep their meaning), recorded in ``growths``.
Everything starts zeroed: a slot's positions past what its row wrote hold
finite values, which the attention masks.
"""

import logging
import math
import threading
from typing import List, Optional, Tuple

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

# First sizes of a pool; each doubles when reached.
FIRST_SLOTS = 64
FIRST_POSITIONS = 64
FIRST_SENTENCES = 16
# Of the device's free memory, the most a decode's reservation takes: the rest is the step's activations, the
# output layer's logits (rows x vocabulary per member) and the copy a growth makes beside the old tensor.
RESERVE_SHARE = 0.5


def device_free_bytes(device) -> Optional[int]:
    """The free memory of ``device`` where a reservation is bounded by it (CUDA), else None (the CPU: host
    memory is the process's to page, and nothing else there is sized from it)."""
    if torch.device(device).type != "cuda":
        return None
    return torch.cuda.mem_get_info(device)[0]


class SlotNumbers:
    """Numbers ``1 .. capacity - 1`` handed out lowest first, each with a reference count (0 is the pad slot)."""

    def __init__(self, capacity: int):
        self.capacity = 1
        self.free: List[int] = []
        self.refs = [1]  # the pad slot is never handed out
        self.grow(capacity)

    def grow(self, capacity: int):
        """Room for ``capacity`` numbers in all."""
        self.free = list(range(capacity - 1, self.capacity - 1, -1)) + self.free
        self.refs += [0] * (capacity - self.capacity)
        self.capacity = capacity

    def needed(self, n: int) -> int:
        """The capacity that ``take(n)`` needs (the present one if enough are free), doubling."""
        if n <= len(self.free):
            return self.capacity
        return max(2 * self.capacity, self.capacity + n - len(self.free))

    def take(self, n: int) -> List[int]:
        """``n`` free numbers, each counted once (call :meth:`grow` first where :meth:`needed` says so)."""
        out = [self.free.pop() for _ in range(n)]
        for i in out:
            self.refs[i] = 1
        return out

    def retain(self, numbers: List[int]):
        for i in numbers:
            self.refs[i] += 1

    def release(self, numbers: List[int]):
        """Drop one count of each; a number at 0 is free again."""
        for i in numbers:
            self.refs[i] -= 1
            if self.refs[i] == 0:
                self.free.append(i)


def _grown(t: Tensor, dim: int, size: int, fill: float = 0.0) -> Tensor:
    """``t`` in a new tensor of ``size`` along ``dim``, the new part ``fill``."""
    shape = list(t.shape)
    shape[dim] = size
    new = t.new_full(shape, fill)
    new.narrow(dim, 0, t.size(dim)).copy_(t)
    return new


class SlotPool:
    """Every model's key/value slots and encoder keys by sentence slot, for one runner.

    ``lock`` guards the tensors and the numbers: the read-ahead thread starts
    groups (writes encoder keys) while the main thread steps.
    """

    def __init__(self, models, device, dtype):
        self.models = models  # LeanModel per member
        self.device, self.dtype = device, dtype
        self.lock = threading.RLock()
        self.slots = SlotNumbers(FIRST_SLOTS)
        self.sentences = SlotNumbers(FIRST_SENTENCES)
        self.positions = FIRST_POSITIONS
        self.caches = [m.new_cache(FIRST_SLOTS, FIRST_POSITIONS, device, zeroed=True) for m in models]
        self.keys = self.values = self.masks = None  # per model: per layer (sentence slots, H, T, hd); masks
        # (what, size before, size after) of each growth past the sizes reserved (tests count them).
        self.growths: List[tuple] = []
        self.reserved_source = 0  # the source length the encoder keys are made with, at least
        # (bytes wanted, bytes the device had room for) where a reservation was cut to fit; None: none was
        self.reserve_cut: Optional[Tuple[int, int]] = None

    def reserve(self, slots: int, sentences: int, positions: int, source: int = 0):
        """Room for ``slots`` key/value slots, ``sentences`` sentence slots (pad slots not counted), rows of
        ``positions`` positions and sources of ``source`` tokens, allocated now, before the decode's first
        step, not recorded as growths; fewer slots and sentence slots where the device has no room for them
        (:func:`device_free_bytes`, :data:`RESERVE_SHARE`)."""
        with self.lock:
            slots, sentences = self._fitting(slots, sentences, positions, source)
            if slots + 1 > self.slots.capacity:
                self._grow_slots(slots + 1)
            self._grow_positions(positions)
            self.reserved_source = max(self.reserved_source, source)
            if self.keys is None:
                # The encoder keys are made at the first batch (their sizes: these at least).
                self.sentences.grow(max(sentences + 1, self.sentences.capacity))
                return
            if sentences + 1 > self.sentences.capacity:
                self._grow_sentences(sentences + 1)
            self._grow_source(source)

    def _fitting(self, slots: int, sentences: int, positions: int, source: int) -> Tuple[int, int]:
        """``slots`` and ``sentences`` scaled down to what :data:`RESERVE_SHARE` of the device's free memory
        holds (the caches and encoder keys are the pool's memory; positions and source lengths are the
        decode's and stay), with one log line; as they are where they fit or the device is not bounded."""
        free = device_free_bytes(self.device)
        if free is None:
            return slots, sentences
        # Keys and values of each layer, every head, a position, read off the caches (2 * layers, slots, heads,
        # positions, head_dim): the self-attention cache's per slot, the encoder keys' per sentence slot.
        per_position = sum(c.numel() // (c.size(1) * c.size(3)) * c.element_size() for c in self.caches)
        wanted = per_position * (slots * positions + sentences * source)
        budget = int(RESERVE_SHARE * free)
        if wanted <= budget:
            return slots, sentences
        scale = budget / wanted
        fit = max(FIRST_SLOTS, int(slots * scale)), max(FIRST_SENTENCES, int(sentences * scale))
        self.reserve_cut = (wanted, budget)
        logger.info("fairseq-stream: the slot pool reserves %d of the %d key/value slots the schedule can hold "
                    "(%.1f of %.1f GB: %d%% of the device's %.1f GB free); it grows past them as the decode "
                    "needs (each growth captures the step's graphs again)", fit[0], slots,
                    scale * wanted / 1e9, wanted / 1e9, round(100 * RESERVE_SHARE), free / 1e9)
        return fit

    @property
    def shape(self) -> tuple:
        """(key/value slots, positions, sentence slots, source positions): a graph of the step holds the pool's
        tensors, so one captured before the pool grew must be captured again."""
        source = self.masks[0].size(3) if self.masks is not None else 0
        return self.slots.capacity, self.positions, self.sentences.capacity, source

    def take_slots(self, n: int) -> List[int]:
        """``n`` key/value slots (the caches grow where needed)."""
        with self.lock:
            capacity = self.slots.needed(n)
            if capacity > self.slots.capacity:
                self.growths.append(("slots", self.slots.capacity, capacity))
                self._grow_slots(capacity)
            return self.slots.take(n)

    def _grow_slots(self, capacity: int):
        self.caches = [_grown(c, 1, capacity) for c in self.caches]
        self.slots.grow(capacity)

    def fit_positions(self, positions: int):
        """Caches of at least ``positions`` positions (doubling)."""
        with self.lock:
            if positions > self.positions:
                size = max(positions, 2 * self.positions)
                self.growths.append(("positions", self.positions, size))
                self._grow_positions(size)

    def _grow_positions(self, size: int):
        if size > self.positions:
            self.caches = [_grown(c, 3, size) for c in self.caches]
            self.positions = size

    def add_sentences(self, encoders) -> List[int]:
        """Sentence slots holding ``encoders`` (one :class:`EncoderKeys` per model, same sentences)."""
        S, T = encoders[0].sentences, encoders[0].source_length
        with self.lock:
            self._fit_sentences(S, T)
            numbers = self.sentences.take(S)
            index = torch.tensor(numbers, dtype=torch.long).to(self.device)
            for i, enc in enumerate(encoders):
                for pool, part in zip(self.keys[i] + self.values[i], enc.keys + enc.values):
                    pool.narrow(2, 0, T).index_copy_(0, index, part)
                mask = torch.full((S, 1, 1, self.masks[i].size(3)), -math.inf, dtype=self.dtype, device=self.device)
                mask[:, :, :, :T] = 0 if enc.mask is None else enc.mask
                self.masks[i].index_copy_(0, index, mask)
            return numbers

    def _fit_sentences(self, S: int, T: int):
        if self.keys is None:
            capacity = max(FIRST_SENTENCES, 2 * S, self.sentences.capacity)
            self.sentences.grow(capacity)
            self.keys, self.values, self.masks = [], [], []
            T = max(T, self.reserved_source)
            for m in self.models:
                shape = (capacity, m.heads, T, m.head_dim)
                self.keys.append([torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in m.layers])
                self.values.append([torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in m.layers])
                self.masks.append(torch.zeros(capacity, 1, 1, T, dtype=self.dtype, device=self.device))
            return
        capacity = self.sentences.needed(S)
        if capacity > self.sentences.capacity:
            self.growths.append(("sentences", self.sentences.capacity, capacity))
            self._grow_sentences(capacity)
        source = self.masks[0].size(3)
        if T > source:
            size = max(T, 2 * source)
            self.growths.append(("source", source, size))
            self._grow_source(size)

    def _grow_sentences(self, capacity: int):
        self._resize(lambda t: _grown(t, 0, capacity), lambda t: _grown(t, 0, capacity))
        self.sentences.grow(capacity)

    def _grow_source(self, size: int):
        source = self.masks[0].size(3)
        if size > source:
            # The pad slot's new positions stay 0 (it must not mask everything); the others' are masked.
            self._resize(lambda t: _grown(t, 2, size), lambda t: _masked_tail(_grown(t, 3, size, -math.inf), source))

    def _resize(self, grow_keys, grow_mask):
        self.keys = [[grow_keys(t) for t in layers] for layers in self.keys]
        self.values = [[grow_keys(t) for t in layers] for layers in self.values]
        self.masks = [grow_mask(m) for m in self.masks]


def _masked_tail(mask: Tensor, source: int) -> Tensor:
    mask[0, :, :, source:] = 0
    return mask
