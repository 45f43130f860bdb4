"""``--search fixed``: fixed-width beam search on our loop (the papers' FIXED-OURS)."""

from dataclasses import dataclass, field

from fairseq.dataclass import ChoiceEnum

from fairseq_stream.registry import register_search
from fairseq_stream.search.common import DecodeStatsConfig, build_scheduled, search_name
from fairseq_stream.search.pruning import Pruning

FinalizeChoice = ChoiceEnum(["fairseq", "stay"])


@dataclass
class FixedSearchConfig(DecodeStatsConfig):
    finalize: FinalizeChoice = field(
        default="fairseq",
        metadata={"help": "fairseq: finalize a hypothesis as soon as it ends in EOS (fairseq's "
                  "SequenceGenerator); stay: finished hypotheses stay on the beam and are output "
                  "only if they become its best entry (Yang et al. 2020, App. A.1)"},
    )


@register_search("fixed", dataclass=FixedSearchConfig)
class FixedSearch:
    """Fixed-width beam search (``--beam`` k), fairseq-compatible or the streaming paper's rule."""

    generators = ("batch", "stream", "fifo", "topup")
    default_generator = "batch"

    @classmethod
    def pruning(cls, search_cfg):
        return Pruning()

    @classmethod
    def build(cls, task, models, gen_cfg, search_cfg, generator_cfg, fairseq_build):
        name = search_name(cls, search_cfg)
        return build_scheduled(
            name, task, models, gen_cfg, search_cfg, generator_cfg, cls.default_generator,
            beam=getattr(gen_cfg, "beam", 5),
            finalize=str(search_cfg.finalize),
            pruning=cls.pruning(search_cfg),
        )
