"""What crosses between a process and its CPU workers (schedule/workers.py): tensors as numpy arrays, and a task's
hypotheses as one array a field.

A worker's result is a list of (sentence id, n-best list) pairs, each
hypothesis fairseq's dict of small CPU tensors (``tokens``,
``score``, ``attention``, ``alignment``, ``positional_scores``: five a
hypothesis, 1,600 for a batch of 64 sentences at k = 5). Sent one numpy array
each, the parent rebuilt 25,000 tensors per 1,000 sentences one by one (issue
50: 0.17 s of the parent's CPU on the Multi30k test set, on the cores the
workers decode on). :class:`_Columns` sends each field of every hypothesis of
a task as one array (the 1-D fields concatenated, with their lengths; the 0-d
ones stacked), and the parent cuts them apart with one ``split`` or
``unbind`` a field.

What the parent gets is what it got before, value for value: the same
dicts, keys in the same order, each tensor of the same dtype, shape and bits,
contiguous and writable (fairseq-generate divides ``positional_scores`` in
place); they are views into one buffer a field instead of a buffer each.
A result of any other shape goes field by field as before (:func:`to_wire`).
"""

from typing import List, Optional, Tuple

import numpy as np
import torch


class _Array:
    """A tensor on its way between processes, as a numpy array: pickling a torch tensor costs about 0.5 ms
    (a 64-sentence batch's hypotheses, 1,300 tensors: 0.7 s there and back), a numpy array microseconds."""

    __slots__ = ("array",)

    def __init__(self, array):
        self.array = array

    def __getstate__(self):
        return self.array

    def __setstate__(self, array):
        self.array = array


class _Columns:
    """[(id, [hypothesis dict, ...]), ...] as one array a field: ``ids``, each list's length (``counts``), the
    field names in order, and per field (its values' array, each value's length or None for 0-d values)."""

    __slots__ = ("ids", "counts", "keys", "fields")

    def __init__(self, ids, counts, keys, fields):
        self.ids, self.counts, self.keys, self.fields = ids, counts, keys, fields

    def __getstate__(self):
        return self.ids, self.counts, self.keys, self.fields

    def __setstate__(self, state):
        self.ids, self.counts, self.keys, self.fields = state


def to_wire(obj):
    """``obj`` with every CPU tensor in its dicts, lists and tuples as an :class:`_Array` (same dtype, same bits);
    a list of (id, hypotheses) pairs as :class:`_Columns` where its hypotheses allow."""
    keys = _columns_of(obj)
    if keys is not None:
        return _packed(obj, keys)
    if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and obj.dtype != torch.bfloat16:
        return _Array(obj.detach().numpy())
    if isinstance(obj, dict):
        return {k: to_wire(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_wire(v) for v in obj)
    return obj


def from_wire(obj):
    """:func:`to_wire` undone: each :class:`_Array` a tensor again, :class:`_Columns` the pairs again."""
    if isinstance(obj, _Columns):
        return _unpacked(obj)
    if isinstance(obj, _Array):
        return torch.from_numpy(obj.array)
    if isinstance(obj, dict):
        return {k: from_wire(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(from_wire(v) for v in obj)
    return obj


def _columns_of(obj) -> Optional[Tuple[str, ...]]:
    """The field names where ``obj`` is a list of (id, list of hypothesis dicts) pairs whose dicts all have
    these keys in this order, each field a CPU tensor of one dtype and one dimension (0 or 1); else None."""
    if type(obj) is not list or not all(type(p) is tuple and len(p) == 2 and type(p[1]) is list for p in obj):
        return None
    hyps = [h for _, nbest in obj for h in nbest]
    if not hyps or not all(type(h) is dict for h in hyps):
        return None
    keys = tuple(hyps[0])
    kinds = [_kind(v) for v in hyps[0].values()]
    if None in kinds:
        return None
    for h in hyps:
        if tuple(h) != keys or any(_kind(v) != kind for v, kind in zip(h.values(), kinds)):
            return None
    return keys


def _kind(value) -> Optional[tuple]:
    if (isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.dtype != torch.bfloat16
            and value.dim() <= 1):
        return value.dtype, value.dim()
    return None


def _packed(pairs: list, keys: Tuple[str, ...]) -> _Columns:
    hyps = [h for _, nbest in pairs for h in nbest]
    fields = []
    for key in keys:
        values = [h[key].detach() for h in hyps]
        if values[0].dim() == 0:
            fields.append((torch.stack(values).numpy(), None))
        else:
            fields.append((torch.cat(values).numpy(), np.array([v.numel() for v in values], dtype=np.int64)))
    return _Columns([i for i, _ in pairs], [len(nbest) for _, nbest in pairs], keys, fields)


def _unpacked(columns: _Columns) -> List[tuple]:
    values = []
    for array, lengths in columns.fields:
        tensor = torch.from_numpy(array)
        values.append(tensor.unbind(0) if lengths is None else tensor.split(lengths.tolist()))
    hyps = [dict(zip(columns.keys, fields)) for fields in zip(*values)]
    out, start = [], 0
    for key, count in zip(columns.ids, columns.counts):
        out.append((key, hyps[start:start + count]))
        start += count
    return out
