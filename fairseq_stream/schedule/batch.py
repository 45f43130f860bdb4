"""``--generator batch``: static batches exactly as fairseq forms them."""

from dataclasses import dataclass

from fairseq.dataclass import FairseqDataclass

from fairseq_stream.registry import register_generator


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
