"""``--search greedy``: argmax decoding on our loop (the reference Jacobi decoding reproduces)."""

from dataclasses import dataclass

from fairseq_stream.registry import register_search
from fairseq_stream.build import OurSearch, SearchSettings
from fairseq_stream.plugin.common import DecodeStatsConfig


@dataclass
class GreedySearchConfig(DecodeStatsConfig):
    """Greedy has no options of its own; ``--beam`` is ignored (always 1)."""


@register_search("greedy", dataclass=GreedySearchConfig)
class GreedySearch(OurSearch):
    """Pick the most probable next token; a sentence ends at EOS or its maximum length."""

    generators = ("batch", "stream", "fifo", "topup")
    default_generator = "batch"
    uses_beam = False  # --beam is ignored

    @classmethod
    def settings(cls, gen_cfg, search_cfg) -> SearchSettings:
        # Greedy promises greedy's tokens, not fairseq's bitwise arithmetic:
        # auto takes the lean runner and the fused output layer.
        return SearchSettings(beam=1, keep_reference=False)
