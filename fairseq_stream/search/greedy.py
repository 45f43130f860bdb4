"""``--search greedy``: argmax decoding on our loop (the reference Jacobi decoding reproduces)."""

from dataclasses import dataclass

from fairseq_stream.registry import register_search
from fairseq_stream.search.common import DecodeStatsConfig, build_scheduled
from fairseq_stream.search.pruning import Pruning


@dataclass
class GreedySearchConfig(DecodeStatsConfig):
    """Greedy has no options of its own; ``--beam`` is ignored (always 1)."""


@register_search("greedy", dataclass=GreedySearchConfig)
class GreedySearch:
    """Pick the most probable next token; a sentence ends at EOS or its maximum length."""

    generators = ("batch", "stream", "fifo", "topup")
    default_generator = "batch"
    uses_beam = False  # --beam is ignored

    @classmethod
    def build(cls, task, models, gen_cfg, search_cfg, generator_cfg, fairseq_build):
        return build_scheduled(
            "greedy", task, models, gen_cfg, search_cfg, generator_cfg, cls.default_generator,
            beam=1, finalize="fairseq", pruning=Pruning(),
            # Greedy promises greedy's tokens, not fairseq's bitwise arithmetic:
            # auto takes the lean runner and the fused output layer.
            keep_reference=False,
        )
