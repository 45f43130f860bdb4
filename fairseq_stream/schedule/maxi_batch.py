"""Maxi-batching (Marian's ``--maxi-batch``): batches cut from windows of M x batch-size input sentences, each
window sorted by length.

One rule for both ways in: fairseq-generate's ``--maxi-batch`` reorders
fairseq's length-sorted dataset indices before fairseq cuts its batches
(:func:`reordered`), and the Python API's ``Translator(maxi_batch=m)`` cuts
the sentences it reads lazily (:func:`windows`). Sorting is stable: equal
lengths keep input order.
"""

import itertools
from typing import Callable, Iterable, Iterator, List, Optional, TypeVar

import numpy as np

from fairseq_stream.errors import FairseqStreamError

FLAG = "--maxi-batch"
HELP = ("cut batches from windows of M x --batch-size input sentences, each sorted by length (Marian's "
        "maxi-batch); 1: input order, unsorted (default: fairseq's order, the whole input sorted)")

Item = TypeVar("Item")


def check(m: Optional[int]):
    """Refuse a ``--maxi-batch`` below 1 (None, not given, keeps fairseq's order)."""
    if m is not None and m < 1:
        raise FairseqStreamError("{} must be at least 1, got {}".format(FLAG, m))


def windows(items: Iterable[Item], m: int, batch_size: int,
            key: Optional[Callable[[Item], object]] = None) -> Iterator[List[Item]]:
    """``items``, read lazily in input order, in windows of ``m`` x ``batch_size``, each sorted stably by
    ``key`` (None: kept in input order); the last window holds what is left."""
    items = iter(items)
    size = m * batch_size
    while True:
        window = list(itertools.islice(items, size))
        if not window:
            return
        if key is not None:
            window.sort(key=key)
        yield window


def reordered(indices: np.ndarray, m: int, batch_size: Optional[int]) -> np.ndarray:
    """fairseq's length-sorted ``indices`` reordered into windows of ``m`` x ``batch_size`` input sentences.

    Dataset indices are input positions, and fairseq hands them over sorted
    by length: within each window of input positions the sentences keep that
    length order (a stable sort by rank); ``m`` = 1 gives input order.
    """
    if not batch_size:
        raise FairseqStreamError("{} needs --batch-size (a window is M batches of --batch-size sentences)"
                                 .format(FLAG))
    if indices.size == 0:
        return indices
    rank = np.empty(int(indices.max()) + 1, dtype=np.int64)
    rank[indices] = np.arange(indices.size)
    by_position = np.sort(indices).tolist()
    order = itertools.chain.from_iterable(windows(by_position, m, int(batch_size), key=rank.__getitem__))
    return np.fromiter(order, dtype=indices.dtype, count=indices.size)
