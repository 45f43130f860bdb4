"""``--search beam``: fairseq's own SequenceGenerator, passed through unchanged.

It exists so that the plugin path (``--user-dir fairseq_stream --search ...``)
works end to end with the reference decoder, and so that benchmarks can name
fairseq's beam search the same way as ours.
"""

from dataclasses import dataclass

from fairseq.dataclass import FairseqDataclass

from fairseq_stream.registry import register_search


@dataclass
class FairseqBeamConfig(FairseqDataclass):
    """No options of its own: fairseq's ``--beam``, ``--lenpen``, ... apply as usual."""


@register_search("beam", dataclass=FairseqBeamConfig)
class FairseqBeam:
    """fairseq's ``SequenceGenerator`` as ``task.build_generator`` makes it."""

    generators = ("batch",)
    default_generator = "batch"
    fairseq_generator = True  # every fairseq generation option applies as usual

    @classmethod
    def build(cls, task, models, gen_cfg, search_cfg, generator_cfg, fairseq_build):
        """Return fairseq's generator: ``fairseq_build()`` is the task's own builder."""
        return fairseq_build()
