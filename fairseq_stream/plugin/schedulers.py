"""The ``--generator`` entries: which sentences are decoded together, and when.

``batch`` decodes fairseq's batches as fairseq forms them; ``stream``
(VAR-STREAM), ``fifo`` (VAR-STR-FIFO) and ``topup`` (Marian's top-up) put the
decoder in a :class:`~fairseq_stream.schedule.stream.StreamGenerator`, each
entry reading its own options into the pool's settings. The schedulers
themselves are :mod:`fairseq_stream.schedule`; an entry only registers one
with fairseq and builds it (:func:`fairseq_stream.build.build_generator` calls
``build``).
"""

from dataclasses import dataclass

from fairseq.dataclass import FairseqDataclass

from fairseq_stream.registry import register_generator
from fairseq_stream.schedule import topup
from fairseq_stream.schedule.stream import FifoOptions, StreamOptions, build_stream_generator, pool_settings


@dataclass
class BatchSchedulerConfig(FairseqDataclass):
    """No options: the batches are fairseq's (``--batch-size``, ``--max-tokens``)."""


@register_generator("batch", dataclass=BatchSchedulerConfig)
class BatchScheduler:
    """Decode each batch fairseq hands over on its own; finished sentences leave it."""

    streams = False  # no --stream-* options

    @classmethod
    def build(cls, decoder, options, task, models, gen_cfg):
        """The decoder itself: it is a fairseq generator of whole batches."""
        return decoder


@register_generator("stream", dataclass=StreamOptions)
class StreamScheduler:
    """VAR-STREAM (Yang et al. 2020): refill the pool at epsilon, expand the shortest prefixes."""

    order = "shortest"
    streams = True  # takes the --stream-* options

    @classmethod
    def pool_settings(cls, options) -> dict:
        """The pool's settings of this entry's ``options``, checked: ε is ``--stream-eps``, prefixes in ``order``."""
        return pool_settings(options, cls.order)

    @classmethod
    def build(cls, decoder, options, task, models, gen_cfg):
        """``decoder`` in a :class:`StreamGenerator` whose pool runs on this entry's :meth:`pool_settings`."""
        return build_stream_generator(decoder, task, models, gen_cfg, options, cls.pool_settings(options))


@register_generator("fifo", dataclass=FifoOptions)
class FifoScheduler(StreamScheduler):
    """VAR-STR-FIFO (Yang et al. 2020, App. A.2): longest prefixes first, up to the capacity."""

    order = "fifo"


@register_generator("topup", dataclass=topup.TopupOptions)
class TopupScheduler(StreamScheduler):
    """Top-up batching (:mod:`fairseq_stream.schedule.topup`): the stream entry's generator, FIFO, refilled at ``--topup-threshold``."""

    order = topup.ORDER

    @classmethod
    def pool_settings(cls, options) -> dict:
        """Top-up's pool settings (:func:`fairseq_stream.schedule.topup.pool_settings`)."""
        return topup.pool_settings(options)
