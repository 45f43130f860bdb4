"""``--search fixed``: fixed-width beam search on our loop (the papers' FIXED-OURS)."""

from dataclasses import dataclass

from fairseq.dataclass import ChoiceEnum

from fairseq_stream.registry import register_search
from fairseq_stream.build import OurSearch, SearchSettings
from fairseq_stream.option_field import option
from fairseq_stream.plugin.common import DecodeStatsConfig
from fairseq_stream.search.pruning import Pruning

FinalizeChoice = ChoiceEnum(["fairseq", "stay"])


@dataclass
class FixedSearchConfig(DecodeStatsConfig):
    finalize: FinalizeChoice = option("fairseq", "fairseq: finalize a hypothesis as soon as it ends in EOS (fairseq's "
                                      "SequenceGenerator); stay: finished hypotheses stay on the beam and are output "
                                      "only if they become its best entry (Yang et al. 2020, App. A.1)")


@register_search("fixed", dataclass=FixedSearchConfig)
class FixedSearch(OurSearch):
    """Fixed-width beam search (``--beam`` k), fairseq-compatible or the streaming paper's rule."""

    generators = ("batch", "stream", "fifo", "topup")
    default_generator = "batch"

    @classmethod
    def pruning(cls, search_cfg):
        return Pruning()

    @classmethod
    def settings(cls, gen_cfg, search_cfg) -> SearchSettings:
        return SearchSettings(beam=getattr(gen_cfg, "beam", 5), finalize=str(search_cfg.finalize),
                              pruning=cls.pruning(search_cfg))
