"""``--search var``: variable-width beam search with Freitag & Al-Onaizan's pruning.

``--search var-batch`` is the streaming paper's VAR-BATCH preset: absolute
threshold δ=1.5, max candidates per node M=5, ``--finalize stay``; any of its
values can still be overridden by the explicit options. ``--search
var-stream`` is the same search on ``--generator stream`` (VAR-STREAM), with
the stream options (``--stream-eps`` ...) in the preset itself.
"""

from dataclasses import dataclass
from typing import Optional

from fairseq_stream.registry import register_search
from fairseq_stream.option_field import option
from fairseq_stream.plugin.fixed import FinalizeChoice, FixedSearch
from fairseq_stream.plugin.common import DecodeStatsConfig
from fairseq_stream.search.pruning import Pruning
from fairseq_stream.schedule.stream import StreamOptions


@dataclass
class VarSearchConfig(DecodeStatsConfig):
    finalize: FinalizeChoice = option("stay", "finalization rule (see --search fixed)")
    prune_rp: Optional[float] = option(None, "relative threshold rp in (0, 1]: drop candidates with probability below "
                                       "rp times the best one's")
    prune_ap: Optional[float] = option(None, "absolute threshold ap (delta) >= 0: drop candidates whose "
                                       "log-probability is more than ap below the best (finished or not)")
    prune_rpl: Optional[float] = option(None, "relative local threshold rpl in (0, 1]: rp on the last word's "
                                        "probability")
    prune_mc: Optional[int] = option(None, "max candidates per node M >= 1: at most M candidates extending the same "
                                     "hypothesis")


@register_search("var", dataclass=VarSearchConfig)
class VarSearch(FixedSearch):
    """Variable-width beam search: ``fixed`` plus any subset of the four heuristics."""

    @classmethod
    def pruning(cls, search_cfg):
        return Pruning(
            rp=search_cfg.prune_rp, ap=search_cfg.prune_ap,
            rpl=search_cfg.prune_rpl, mc=search_cfg.prune_mc,
        )


@dataclass
class VarBatchConfig(VarSearchConfig):
    prune_ap: Optional[float] = option(1.5, "absolute threshold (preset: 1.5)")
    prune_mc: Optional[int] = option(5, "max candidates per node (preset: 5)")


@register_search("var-batch", dataclass=VarBatchConfig)
class VarBatchSearch(VarSearch):
    """VAR-BATCH (Yang et al. 2020): var with δ=1.5, M=5, finalize stay, on --generator batch."""


@dataclass
class VarStreamConfig(VarBatchConfig, StreamOptions):
    """VAR-BATCH's search settings plus the streaming scheduler's options."""


@register_search("var-stream", dataclass=VarStreamConfig)
class VarStreamSearch(VarSearch):
    """VAR-STREAM (Yang et al. 2020): var-batch's search, streamed (refill at epsilon, shortest first)."""

    generators = ("stream",)
    default_generator = "stream"
    includes_generator = True  # its config carries the --stream-* options
