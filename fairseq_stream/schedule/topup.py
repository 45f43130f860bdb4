"""Top-up batching (Marian; Junczys-Dowmunt et al. 2018, Algorithms 4-6), ``--generator topup``.

One batch of ``--stream-pool`` sentences; every decoder call runs every
active sentence (the pool's FIFO order: no shortest first), and when at most
``--topup-threshold`` of the batch is still decoding, finished sentences are
replaced from the encoded ones read ahead. It is the streaming pool
(:class:`~fairseq_stream.schedule.pool.StreamPool`) in FIFO order with this
refill threshold in place of ``--stream-eps``: this module holds its options
and reads them into the pool's settings.
"""

from dataclasses import dataclass

from fairseq_stream.errors import FairseqStreamError
from fairseq_stream.option_field import option
from fairseq_stream.schedule.stream import StreamOptions, parse_eps
from fairseq_stream.schedule.stream import pool_settings as stream_pool_settings

ORDER = "fifo"  # every active sentence in every call
THRESHOLD_FLAG = "--topup-threshold"


@dataclass
class TopupOptions(StreamOptions):
    """The stream options, refilling at ``--topup-threshold`` instead of ``--stream-eps``."""

    topup_threshold: str = option("1/2", "top the batch up from the queue of encoded sentences when at most this "
                                  "fraction of it (--stream-pool, default --batch-size) is still decoding: a fraction "
                                  "(Marian's 1/2) or a decimal in (0, 1]")


def refill_eps(options) -> float:
    """The pool's ε of top-up ``options``: ``--topup-threshold``, checked; a changed ``--stream-eps`` is refused."""
    if str(options.stream_eps) != StreamOptions.stream_eps:
        raise FairseqStreamError("--generator topup refills at --topup-threshold (default 1/2); --stream-eps "
                                 "is --generator stream's and fifo's")
    return parse_eps(options.topup_threshold, THRESHOLD_FLAG)


def pool_settings(options) -> dict:
    """The :class:`StreamPool` keyword arguments of top-up ``options`` (a :class:`TopupOptions` or anything with
    its fields), checked (one-line errors)."""
    return stream_pool_settings(options, ORDER, refill_eps)
