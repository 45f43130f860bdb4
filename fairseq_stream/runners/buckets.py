"""The static-slot runner's buckets: the sizes a step's rows and key positions are padded up to.

A CUDA graph replays fixed shapes, so a step's rows are padded to the next
bucket (vLLM and TensorRT-LLM capture a graph per batch size the same way)
and its keys are read to a multiple of a position bucket.
"""

import bisect
from typing import Sequence

from fairseq_stream.errors import FairseqStreamError


def bucket(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket holding ``n`` (past the largest: ``n`` rounded up to a multiple of it)."""
    at = bisect.bisect_left(buckets, n)
    if at < len(buckets):
        return buckets[at]
    return -(-n // buckets[-1]) * buckets[-1]


def parse_buckets(text: str):
    """``--static-buckets ROWS[,ROWS...][:POSITIONS]`` as (row buckets or None, length bucket or None).

    E.g. ``8,16,32,64,128:16``: rows padded to the next of those sizes, keys
    read to a multiple of 16 positions; ``:16`` pads positions only.
    """
    rows, _, length = text.partition(":")
    try:
        row_buckets = sorted({int(r) for r in rows.split(",")}) if rows.strip() else None
        length_bucket = int(length) if length.strip() else None
    except ValueError:
        raise FairseqStreamError("--static-buckets takes ROWS[,ROWS...][:POSITIONS] (e.g. 8,16,32,64:16), "
                                 "got {!r}".format(text)) from None
    if any(r < 1 for r in row_buckets or ()) or (length_bucket is not None and length_bucket < 1):
        raise FairseqStreamError("--static-buckets: sizes must be at least 1, got {!r}".format(text))
    return row_buckets, length_bucket
