"""What every search entry of ours shares: the runner, output-layer and statistics options, and their checks."""

from dataclasses import dataclass
from typing import Optional

from fairseq.dataclass import ChoiceEnum

from fairseq_stream.errors import FairseqStreamError
from fairseq_stream.option_field import option
from fairseq_stream.output_choice import OUTPUT_LAYERS, check_output_layer
from fairseq_stream.runners import QUANTIZE, RUNNERS, check_runner
from fairseq_stream.runners.rnn import RnnOptions, RnnRunnerConfig
from fairseq_stream.runners.buckets import parse_buckets

RunnerChoice = ChoiceEnum(list(RUNNERS))
QuantizeChoice = ChoiceEnum(list(QUANTIZE))
OutputLayerChoice = ChoiceEnum(list(OUTPUT_LAYERS))
StackChoice = ChoiceEnum(["auto", "on", "off"])
CudaGraphsChoice = ChoiceEnum(["auto", "on", "off"])


@dataclass
class DecodeStatsConfig(RnnRunnerConfig):
    """Options every search of ours shares: statistics, the model runner (and the rnn runner's own,
    registered by it), the output layer."""

    stats_file: Optional[str] = option(None, "write decoding counters (sentences, timesteps, expansions, "
                                       "expansions_per_step, wall_s) as JSON to this file")
    stats_steps: bool = option(False, "also record every decoder step (length, rows, seconds) in --stats-file")
    # Every search of ours runs on a runner, so the option lives with the
    # options every search shares.
    runner: RunnerChoice = option("auto", "model runner: fairseq (fairseq's own decoder calls, the reference), lean "
                                  "(our incremental step for fairseq transformers: preallocated caches, shared "
                                  "encoder keys, fused projections), rnn (our step for fairseq LSTM models with "
                                  "Devlin 2017's tricks), static (the lean step over key/value slots allocated once: "
                                  "reorders move indices, fixed shapes; see docs/GPU.md) or auto (lean for supported "
                                  "transformers, rnn for supported LSTMs, else fairseq; --search fixed --finalize "
                                  "fairseq keeps fairseq)")
    quantize: QuantizeChoice = option("none", "run every product of the model on weights quantized once at load (CPU, "
                                      "float32 models): int8 (per-row scales, AVX-512 VNNI / AVX2 kernels; its "
                                      "weights 8-bit, or 7-bit where AVX2 is the CPU's best int8 code), int8w8 / "
                                      "int8w7 (that width on every CPU) or int16; transformers on the lean runner, "
                                      "LSTMs (int16) on the rnn runner; none keeps float")
    cpu_threads: Optional[int] = option(None, "threads a CPU decode on our runners (lean, static, rnn) uses: our "
                                        "kernels split their work over them, torch's ops run on one (default: the "
                                        "cores this process may use, at most torch's thread count, OMP_NUM_THREADS); "
                                        "fairseq's runner keeps torch's threads")
    cpu_workers: Optional[int] = option(None, "worker processes decoding batches at once on the CPU (CTranslate2's "
                                        "inter_threads), each with its own decoder state and --cpu-threads kernel "
                                        "threads; results in input order, the same bits as one worker where each "
                                        "batch is decoded on its own (default: one a core on --generator batch in "
                                        "fairseq-generate and fairseq-interactive, else 1; our runners only)")
    stack_members: StackChoice = option("auto", "lean and static runners, an ensemble whose members share a shape: on runs them "
                                        "stacked (each product once for all members, one cache), off one after "
                                        "another, auto stacked where the members' step is not compiled (CUDA: "
                                        "stacked; the CPU keeps each member's compiled step, measured faster there; "
                                        "docs/ensemble.md)")
    static_buckets: str = option("", "--runner static: pad each step's rows up to the next of these sizes and read "
                                 "keys to a multiple of POSITIONS, as ROWS[,ROWS...][:POSITIONS] (e.g. "
                                 "8,16,32,64,128:16): the fixed shapes a CUDA graph of the step needs (docs/GPU.md); "
                                 "empty: no padding")
    cuda_graphs: CudaGraphsChoice = option("auto", "--runner static on CUDA: capture the step in CUDA graphs per "
                                           "bucket of rows and key positions and replay them (on; an error on the "
                                           "CPU or another runner), eager steps (off), or on where it applies "
                                           "(auto: --runner static on CUDA). Not run on a GPU yet: docs/GPU.md")
    host_lag: int = option(0, "read each step's summary (which sentences ended) this many decoder calls late, so "
                           "that on a GPU the host never waits on the step it just launched; the rows of a "
                           "sentence that ended keep stepping, masked, until read. Greedy and fixed width with "
                           "--finalize fairseq on --runner static or lean; same output as 0 (bitwise where the "
                           "rows are padded to one --static-buckets bucket). 0 (default) reads at once: the CPU's "
                           "best; 2 on CUDA (docs/GPU.md)")
    output_layer: OutputLayerChoice = option("auto", "output layer: torch (log-softmax over the vocabulary, then the "
                                             "rules and top-k: the reference), fused (bias + log-softmax + rules + "
                                             "top-k in one compiled kernel pass; an error if no kernel is built) or "
                                             "auto (fused where a kernel is built for the device, else torch; "
                                             "--search fixed --finalize fairseq keeps torch)")


# fairseq generation options our loop does not implement; each is refused by
# name rather than silently ignored.
UNSUPPORTED_GENERATION = (
    ("sampling", "--sampling"),
    ("match_source_len", "--match-source-len"),
    ("constraints", "--constraints"),
    ("print_alignment", "--print-alignment"),
    ("lm_path", "--lm-path"),
    ("prefix_size", "--prefix-size"),
    ("score_reference", "--score-reference"),
)
# Options that print what only fairseq's iterative refinement generators return (--task translation_lev):
# fairseq-generate reads it from each hypothesis and fails after the first sentence on ours.
ITERATIVE_ONLY = (("print_step", "--print-step"), ("retain_iter_history", "--retain-iter-history"))


def search_name(search_cls, search_cfg=None) -> str:
    """The ``--search`` name that messages give for ``search_cls``.

    fairseq sets ``_name`` on the config it parses; a config built directly
    (``task.build_generator`` with a Namespace, a dataclass made in Python)
    has ``_name`` None, and errors must still name the search the user chose.
    """
    from fairseq_stream.registry import SEARCH_REGISTRY

    name = getattr(search_cfg, "_name", None)
    if name:
        return str(name)
    # Subclasses share build() (var is fixed's): find the entry registered for this very class.
    return next((n for n, c in SEARCH_REGISTRY.items() if c is search_cls), search_cls.__name__)


def check_beam(beam):
    """Refuse a beam width below 1 (fairseq's decoder fails deep inside on it)."""
    if beam is None or int(beam) < 1:
        raise FairseqStreamError("--beam must be at least 1, got {}".format(beam))


def check_lengths(gen_cfg):
    """Refuse ``--nbest`` below 1 and a ``--min-len`` above a maximum length that does not grow with the source.

    Both failed deep inside: ``--nbest 0`` ended fairseq-generate in a
    ZeroDivisionError after a whole run with nothing printed, and ``--search
    beam`` stopped at its first batch on fairseq's AssertionError. A maximum
    that grows with the source (``--max-len-a`` > 0) is checked per batch.
    """
    nbest = getattr(gen_cfg, "nbest", 1)
    if nbest is None or int(nbest) < 1:
        raise FairseqStreamError("--nbest must be at least 1, got {}".format(nbest))
    min_len, max_len_b = getattr(gen_cfg, "min_len", 1) or 0, getattr(gen_cfg, "max_len_b", 200)
    if not getattr(gen_cfg, "max_len_a", 0) and max_len_b is not None and min_len > max_len_b:
        raise FairseqStreamError("--min-len {} is larger than the maximum length --max-len-b {}; adjust "
                                 "--max-len-a/-b".format(min_len, max_len_b))


def check_sampling_and_temperature(gen_cfg):
    """Refuse what fairseq's generator asserts when it is built (a traceback there), for every search.

    ``--sampling-topk``/``--sampling-topp`` without ``--sampling``: fairseq
    refuses them; our searches, which do not sample, ignored them silently.
    """
    sampling = getattr(gen_cfg, "sampling", False)
    for attr, flag in (("sampling_topk", "--sampling-topk"), ("sampling_topp", "--sampling-topp")):
        value = getattr(gen_cfg, attr, -1)
        if value is not None and value >= 0 and not sampling:
            raise FairseqStreamError("{} {} needs --sampling (it chooses what sampling draws from)".format(
                flag, value))
    temperature = getattr(gen_cfg, "temperature", 1.0)
    if temperature is not None and not temperature > 0:
        raise FairseqStreamError("--temperature must be greater than 0, got {}".format(temperature))


def check_nbest(search_name, search_cls, gen_cfg):
    """Refuse an ``--nbest`` our search cannot give (fairseq-generate would print fewer, silently).

    Greedy and Jacobi keep one hypothesis a sentence; a beam search keeps at
    most ``--beam`` (pruning may leave fewer, which is the method, not a
    silent cap).
    """
    nbest = int(getattr(gen_cfg, "nbest", 1))
    if nbest <= 1:
        return
    if not getattr(search_cls, "uses_beam", True):
        raise FairseqStreamError(
            "--search {} gives one hypothesis per sentence: --nbest {} asks for {} (for an n-best list use "
            "--search fixed --beam {} --nbest {})".format(search_name, nbest, nbest, max(nbest, 5), nbest))
    beam = int(getattr(gen_cfg, "beam", 5))
    if nbest > beam:
        raise FairseqStreamError("--nbest {} asks for more hypotheses than --beam {} keeps; raise --beam to {} "
                                 "or more".format(nbest, beam, nbest))


def ignored_beam_note(search_name, search_cls, beam) -> Optional[str]:
    """The log line for a ``--beam`` that a greedy search (greedy, jacobi) does not use, else None."""
    if getattr(search_cls, "uses_beam", True) or beam is None or int(beam) == 1:
        return None
    return ("fairseq-stream: --search {} decodes greedily (one hypothesis, beam 1): --beam {} is ignored"
            .format(search_name, beam))


def check_generation_options(search_name, gen_cfg):
    """Refuse fairseq generation options this search does not support, naming them."""
    for attr, flag in UNSUPPORTED_GENERATION:
        if getattr(gen_cfg, attr, None):
            raise FairseqStreamError(
                "--search {} does not support {} (use --search beam for it)".format(search_name, flag)
            )
    if getattr(gen_cfg, "diverse_beam_groups", -1) > 0 or getattr(gen_cfg, "diversity_rate", -1) > -1:
        raise FairseqStreamError(
            "--search {} does not support diverse beam search (use --search beam)".format(search_name)
        )
    for attr, flag in ITERATIVE_ONLY:
        if getattr(gen_cfg, attr, False):
            raise FairseqStreamError("--search {} does not support {}: it prints what only iterative "
                                     "refinement returns (--task translation_lev)".format(search_name, flag))
    # Set even when empty (fairseq then copies the aligned source word).
    if getattr(gen_cfg, "replace_unk", None) is not None:
        raise FairseqStreamError("--search {} does not support --replace-unk: it needs alignments, which our "
                                 "searches do not produce (fairseq's own beam search has them: --search beam "
                                 "--print-alignment, where fairseq reads raw text, as fairseq-interactive does)"
                                 .format(search_name))


def check_search_options(search_name, search_cls, gen_cfg, search_cfg, stream_cfg=None, scheduler=None):
    """Check every option of a search before any model is loaded (one-line errors).

    Shared by the command line (right after parsing) and the Python API.

    Args:
        search_cls: the registry entry of ``search_name``.
        gen_cfg: fairseq's generation options (``beam``, ``sampling`` ...).
        search_cfg: the search's own options (pruning thresholds).
        stream_cfg: the ``--stream-*`` options, where the search streams.
        scheduler: the ``--generator`` name whose entry reads ``stream_cfg``
            (None: ``stream``'s rules, as the Python API's pool runs).
    """
    from fairseq_stream.registry import GENERATOR_REGISTRY

    if getattr(search_cls, "uses_beam", True):
        check_beam(getattr(gen_cfg, "beam", 5))
    check_lengths(gen_cfg)
    check_sampling_and_temperature(gen_cfg)
    if not getattr(search_cls, "supports_no_repeat_ngram", True) and getattr(gen_cfg, "no_repeat_ngram_size", 0):
        raise FairseqStreamError("--search {} does not support --no-repeat-ngram-size (use --search greedy)"
                                 .format(search_name))
    if not getattr(search_cls, "fairseq_generator", False):
        check_nbest(search_name, search_cls, gen_cfg)
        check_generation_options(search_name, gen_cfg)
    elif getattr(gen_cfg, "sampling", False) and getattr(gen_cfg, "nbest", 1) != getattr(gen_cfg, "beam", 5):
        # fairseq-generate and -interactive assert this (a traceback).
        raise FairseqStreamError("--sampling needs --nbest equal to --beam (got --nbest {}, --beam {})"
                                 .format(gen_cfg.nbest, gen_cfg.beam))
    check_runner(str(getattr(search_cfg, "runner", "auto")), RnnOptions.from_config(search_cfg).int16,
                 str(getattr(search_cfg, "quantize", "none")), str(getattr(search_cfg, "stack_members", "auto")))
    check_output_layer(getattr(search_cfg, "output_layer", "auto"))
    _check_static_buckets(search_cfg)
    if hasattr(search_cls, "pruning"):
        search_cls.pruning(search_cfg)
    if hasattr(search_cls, "check"):
        search_cls.check(search_cfg)
    if stream_cfg is not None:
        GENERATOR_REGISTRY[scheduler or "stream"].pool_settings(stream_cfg)


def _check_static_buckets(search_cfg):
    """A one-line error for ``--static-buckets`` that does not parse or is given without ``--runner static``."""
    text = str(getattr(search_cfg, "static_buckets", "") or "")
    if not text:
        return
    parse_buckets(text)
    if str(getattr(search_cfg, "runner", "auto")) != "static":
        raise FairseqStreamError("--static-buckets is for --runner static (got --runner {})".format(
            getattr(search_cfg, "runner", "auto")))
