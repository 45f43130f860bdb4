"""``--search jacobi``: greedy's output by Jacobi parallel decoding (Santilli et al. 2023).

The loop is :mod:`fairseq_stream.jacobi.decoder`; this entry reads the
options and builds it on a greedy decoder (whose rules it reproduces).
"""

from dataclasses import dataclass
from typing import Optional

from fairseq.dataclass import ChoiceEnum

from fairseq_stream.jacobi.calibration import CALIBRATE
from fairseq_stream.jacobi.decoder import VARIANTS, JacobiDecoder, check_options
from fairseq_stream.jacobi.drafts import DRAFTS
from fairseq_stream.option_field import option
from fairseq_stream.registry import register_search
from fairseq_stream.build import OurSearch, SearchSettings
from fairseq_stream.plugin.common import DecodeStatsConfig


@dataclass
class JacobiSearchConfig(DecodeStatsConfig):
    jacobi_variant: ChoiceEnum(list(VARIANTS)) = option("hgj", "pj: refine the whole rest of the sentence at once; "
                                                        "pgj: blocks of --jacobi-block positions; hgj: a window of "
                                                        "--jacobi-block positions after the verified prefix, greedy "
                                                        "steps after --jacobi-horizon tokens")
    jacobi_block: Optional[int] = option(None, "b: the window of pgj and hgj, in positions (1 is greedy); default: "
                                         "hgj 3 while a call decodes one sentence and 2 when several share it (the "
                                         "fastest of each measured on the CPU, docs/BENCHMARKS.md), pgj 2")
    jacobi_draft: ChoiceEnum(list(DRAFTS)) = option("ngram", "what fills a window after its verified token: pad (the "
                                                    "paper: PAD, then the previous iteration's guesses, every row its "
                                                    "whole window) or ngram (first the continuation of the last one "
                                                    "to three tokens in the sentences decoded so far, then the "
                                                    "guesses, only as many as pay for their positions: see "
                                                    "--jacobi-call-cost)")
    jacobi_horizon: Optional[int] = option(None, "hgj: decode by windows up to this many tokens, by greedy steps "
                                           "after (default: the whole sentence)")
    jacobi_call_cost: Optional[float] = option(None, "ngram drafts with pgj/hgj: a decoder call's fixed cost, in "
                                               "window positions; a draft token is run only if its chance of "
                                               "acceptance is at least rows / (rows + this), and batches where that "
                                               "bar reaches 0.15 on a CPU (3 sentences at the default) or 1/3 on a "
                                               "GPU (half this many sentences) run greedy's own step (default: 15 on "
                                               "a CPU, measured; 200 on a GPU)")
    jacobi_calibrate: ChoiceEnum(list(CALIBRATE)) = option("auto", "auto: the default setting (hgj, no "
                                                           "--jacobi-block) runs windows only at batch sizes where "
                                                           "they pay on this CPU for this model, greedy's step "
                                                           "elsewhere (the same tokens): the cost of a window call "
                                                           "against a greedy step is measured once per model shape "
                                                           "and CPU and cached under the fairseq-stream cache folder, "
                                                           "the tokens a call verifies are counted as the run goes; "
                                                           "one log line says what was chosen; on: any setting is "
                                                           "calibrated so; off: windows as the setting says")
    jacobi_candidates: int = option(1, "ngram drafts with pgj/hgj: how many of the pool's continuations a window may "
                                    "verify at once, as a tree sharing their first tokens (lookahead decoding's "
                                    "several n-grams; each position still only where it pays, see --jacobi-call-cost)")


@register_search("jacobi", dataclass=JacobiSearchConfig)
class JacobiSearch(OurSearch):
    """Jacobi decoding (PJ, PGJ, HGJ): exactly greedy's tokens in fewer sequential decoder calls."""

    generators = ("batch",)
    default_generator = "batch"
    uses_beam = False  # --beam is ignored: greedy
    supports_no_repeat_ngram = False  # --no-repeat-ngram-size: a window's tokens are drafts, not greedy's choices yet

    @classmethod
    def check(cls, search_cfg):
        """One-line errors for option values argparse lets through (before any model is loaded)."""
        check_options(str(search_cfg.jacobi_variant), search_cfg.jacobi_block, str(search_cfg.jacobi_draft),
                      search_cfg.jacobi_horizon, search_cfg.jacobi_call_cost, search_cfg.jacobi_candidates,
                      str(search_cfg.jacobi_calibrate))

    @classmethod
    def settings(cls, gen_cfg, search_cfg) -> SearchSettings:
        """A greedy decoder (its tokens are the promise, not fairseq's arithmetic) with Jacobi's loop around it."""

        def jacobi(greedy):
            return JacobiDecoder(greedy, variant=str(search_cfg.jacobi_variant), block=search_cfg.jacobi_block,
                                 draft=str(search_cfg.jacobi_draft), horizon=search_cfg.jacobi_horizon,
                                 call_cost=search_cfg.jacobi_call_cost, candidates=search_cfg.jacobi_candidates,
                                 calibrate=str(search_cfg.jacobi_calibrate))

        return SearchSettings(beam=1, keep_reference=False, wrap=jacobi)
