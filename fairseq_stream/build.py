"""The one place a decoder is assembled, for the command line and the Python API alike.

The way in is a :class:`DecoderSpec`: every choice a run makes, typed and
checked, made from fairseq's parsed configs (:func:`spec_from_configs`: the
``--search`` entry's options, fairseq's generation options, the
``--generator`` entry's options). From it, :func:`build_decoder` builds the
model runner, the search (beam width, finalization, pruning) and the decoder
around them (a Jacobi decoder around a greedy one where the search asks), and
:func:`build_generator` puts the decoder on the chosen scheduler: each
``--generator`` entry builds its own loop (``build``), so nothing here
compares scheduler names.

The search entries (:mod:`fairseq_stream.plugin`) only say what is theirs
(:meth:`settings`: beam, finalization, pruning, the decoder they wrap around
the beam decoder); the API builds its own streaming pool around
:func:`build_decoder`'s decoder.
"""

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from fairseq_stream.errors import FairseqStreamError
from fairseq_stream.ops.quantized_linear import INT8_KINDS
from fairseq_stream.ops.threads import check_cpu_threads
from fairseq_stream.runners.rnn import RnnOptions
from fairseq_stream.runners.buckets import parse_buckets
from fairseq_stream.plugin.common import check_search_options, search_name
from fairseq_stream.search.pruning import Pruning

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationRules:
    """fairseq's generation options that our decoders honour, as ``SequenceGenerator`` does."""

    max_len_a: float = 0
    max_len_b: int = 200
    min_len: int = 1
    normalize_scores: bool = True
    len_penalty: float = 1.0
    unk_penalty: float = 0.0
    temperature: float = 1.0
    no_repeat_ngram_size: int = 0
    nbest: int = 1  # hypotheses a sentence the tools print; the pruning searches may keep fewer

    @classmethod
    def from_config(cls, gen_cfg) -> "GenerationRules":
        """The rules of fairseq's ``GenerationConfig`` (or a Namespace with its fields; defaults where absent)."""
        return cls(max_len_a=getattr(gen_cfg, "max_len_a", 0), max_len_b=getattr(gen_cfg, "max_len_b", 200),
                   min_len=getattr(gen_cfg, "min_len", 1),
                   normalize_scores=not getattr(gen_cfg, "unnormalized", False),
                   len_penalty=getattr(gen_cfg, "lenpen", 1), unk_penalty=getattr(gen_cfg, "unkpen", 0),
                   temperature=getattr(gen_cfg, "temperature", 1.0),
                   no_repeat_ngram_size=getattr(gen_cfg, "no_repeat_ngram_size", 0),
                   nbest=int(getattr(gen_cfg, "nbest", 1) or 1))


@dataclass(frozen=True)
class SearchSettings:
    """What a ``--search`` entry decides (:meth:`settings` of each entry).

    ``keep_reference``: None lets the decoder keep fairseq's runner and
    output layer where its search is dense (fixed width, ``--finalize
    fairseq``); False where the search promises its tokens, not fairseq's
    bitwise arithmetic (greedy, Jacobi). ``wrap``: builds the decoder that
    runs around the beam decoder (Jacobi's), or None.
    """

    beam: int
    finalize: str = "fairseq"
    pruning: Pruning = field(default_factory=Pruning)
    keep_reference: Optional[bool] = None
    wrap: Optional[Callable[[Any], Any]] = None


@dataclass(frozen=True)
class DecoderSpec:
    """Every choice of one run: what :func:`build_decoder` and :func:`build_generator` build from."""

    search: str  # the --search name messages give
    settings: SearchSettings
    rules: GenerationRules
    runner: str = "auto"
    quantize: str = "none"  # --quantize: none, int8, int16
    stack_members: Optional[bool] = None  # --stack-members: None auto, True on, False off
    static_buckets: str = ""  # --static-buckets: the static-slot runner's row and key-length buckets
    cuda_graphs: str = "auto"  # --cuda-graphs: capture the static-slot step (runners/step_graphs.py)
    host_lag: int = 0  # --host-lag: read each step's summary this many decoder calls late (late_reads.py)
    output_layer: str = "auto"
    cpu_threads: Optional[int] = None  # --cpu-threads: None chooses (ops/threads.py)
    cpu_workers: Optional[int] = None  # --cpu-workers: None chooses (ops/threads.py, schedule/workers.py)
    rnn: RnnOptions = field(default_factory=RnnOptions)
    stats_file: Optional[str] = None
    stats_steps: bool = False
    scheduler: str = "batch"  # a --generator name
    scheduler_options: Any = None  # that entry's options (the --stream-* group), or None


def spec_from_configs(search_cls, gen_cfg, search_cfg, generator_cfg=None) -> DecoderSpec:
    """The spec of ``--search`` entry ``search_cls`` with fairseq's parsed options, checked (one-line errors).

    ``generator_cfg``: the ``--generator`` entry's options (its ``_name``
    names it); None runs the search's default scheduler, with the stream
    options of a search whose config carries them (``var-stream``).
    """
    from fairseq_stream.registry import GENERATOR_REGISTRY

    name = search_name(search_cls, search_cfg)
    scheduler = getattr(generator_cfg, "_name", None) or search_cls.default_generator
    if scheduler not in GENERATOR_REGISTRY:
        raise FairseqStreamError("--generator must be one of {}, got {}".format(
            ", ".join(sorted(GENERATOR_REGISTRY)), scheduler))
    streams = getattr(GENERATOR_REGISTRY[scheduler], "streams", False)
    options = (generator_cfg if generator_cfg is not None else search_cfg) if streams else None
    check_search_options(name, search_cls, gen_cfg, search_cfg, options, scheduler)
    settings = search_cls.settings(gen_cfg, search_cfg)
    if scheduler != "batch" and settings.keep_reference is None:
        # Bitwise identity with fairseq is a promise of fairseq's own batches only: a scheduler changes
        # the calls' composition (float32 results move in the last bits, as with another --batch-size),
        # and mixing prefix lengths on the fairseq runner pads every row, which the lean runner does not.
        settings = SearchSettings(settings.beam, settings.finalize, settings.pruning, False, settings.wrap)
    return DecoderSpec(
        search=name, settings=settings, rules=GenerationRules.from_config(gen_cfg),
        runner=str(getattr(search_cfg, "runner", "auto")),
        quantize=str(getattr(search_cfg, "quantize", "none")),
        stack_members={"auto": None, "on": True, "off": False}[str(getattr(search_cfg, "stack_members", "auto"))],
        output_layer=str(getattr(search_cfg, "output_layer", "auto")),
        static_buckets=str(getattr(search_cfg, "static_buckets", "") or ""),
        cuda_graphs=str(getattr(search_cfg, "cuda_graphs", "auto")),
        host_lag=_checked_host_lag(settings, search_cfg),
        cpu_threads=check_cpu_threads(getattr(search_cfg, "cpu_threads", None)),
        cpu_workers=check_cpu_threads(getattr(search_cfg, "cpu_workers", None), "--cpu-workers"),
        rnn=RnnOptions.from_config(search_cfg),
        stats_file=getattr(search_cfg, "stats_file", None),
        stats_steps=bool(getattr(search_cfg, "stats_steps", False)),
        scheduler=scheduler, scheduler_options=options,
    )


def _checked_host_lag(settings: SearchSettings, search_cfg) -> int:
    """``--host-lag`` where it holds for the search (one-line errors; the decoder checks the runner it gets)."""
    from fairseq_stream.decoder_parts import is_dense
    from fairseq_stream.late_reads import check

    lag = int(getattr(search_cfg, "host_lag", 0) or 0)
    runner = str(getattr(search_cfg, "runner", "auto"))
    check(lag, is_dense(settings.finalize, settings.pruning), None if runner == "auto" else runner,
          settings.wrap is not None)
    return lag


def spec_from_options(search: str, beam: int, options: dict):
    """The Python API's spec: ``search`` with keyword ``options`` by their dataclass names, checked.

    Each option goes to every config that has a field of its name (the
    search's, the stream pool's, fairseq's generation options); the values
    are those :mod:`fairseq_stream.option_types` typed (the API's
    ``_typed_options``). Returns (spec, the stream options, for the caller's
    own pool).
    """
    from fairseq.dataclass.configs import GenerationConfig

    from fairseq_stream.registry import SEARCH_DATACLASS_REGISTRY, SEARCH_REGISTRY
    from fairseq_stream.schedule.stream import StreamOptions

    if search not in SEARCH_REGISTRY or search == "beam":
        raise FairseqStreamError("search must be one of {} (got {!r})".format(
            ", ".join(sorted(n for n in SEARCH_REGISTRY if n != "beam")), search))
    gen_cfg = GenerationConfig(beam=beam)
    search_cfg = SEARCH_DATACLASS_REGISTRY[search]()
    search_cfg._name = search  # fairseq sets it when parsing; errors name the search by it
    stream_cfg = StreamOptions()
    for key, value in options.items():
        targets = [c for c in (search_cfg, stream_cfg, gen_cfg) if hasattr(c, key)]
        if not targets:
            raise FairseqStreamError("unknown option {!r} for search {}".format(key, search))
        for target in targets:
            setattr(target, key, value)
    return spec_from_configs(SEARCH_REGISTRY[search], gen_cfg, search_cfg), stream_cfg


def build_decoder(spec: DecoderSpec, task, models, workers_by_default: bool = False):
    """The decoder of ``spec`` for ``models``: runner, search and decoder (and what the search wraps around it).

    Its ``cpu_layout`` is the CPU layout set for it (None where the runner
    keeps torch's threads); ``workers_by_default``: worker processes would change no bit
    (:func:`workers_change_no_bit`), so the default layout may take them.
    """
    from fairseq_stream.decoder import BeamDecoder
    from fairseq_stream.decoder_parts import parts, policy
    from fairseq_stream.stats import DecodeStats, StatsReporter

    stats = DecodeStats(keep_steps=spec.stats_steps, nbest=spec.rules.nbest)
    s, rules = spec.settings, spec.rules
    # The decoder is handed its runner, output backend and search policy ready.
    runner, backend = parts(models, task.target_dictionary, s.beam, s.finalize, s.pruning, rules.temperature,
                            rules.no_repeat_ngram_size, spec.runner, spec.output_layer, s.keep_reference, spec.rnn,
                            spec.quantize, spec.stack_members)
    decoder = BeamDecoder(
        models, task.target_dictionary, beam_size=s.beam, finalize=s.finalize, pruning=s.pruning, stats=stats,
        max_len_a=rules.max_len_a, max_len_b=rules.max_len_b, min_len=rules.min_len,
        normalize_scores=rules.normalize_scores, len_penalty=rules.len_penalty, unk_penalty=rules.unk_penalty,
        temperature=rules.temperature, no_repeat_ngram_size=rules.no_repeat_ngram_size,
        runner=runner, output_layer=spec.output_layer, keep_reference=s.keep_reference, output_backend=backend,
        host_lag=spec.host_lag, policy=policy(task.target_dictionary, s.beam, s.finalize, s.pruning),
    )
    if spec.quantize != "none":
        _release_float_weights(decoder.runner, spec.quantize)
    if spec.static_buckets and getattr(decoder.runner, "name", None) == "static":
        decoder.runner.row_buckets, decoder.runner.length_bucket = parse_buckets(spec.static_buckets)
    _capture_steps(decoder.runner, spec.cuda_graphs)
    layout = _lay_out_threads(decoder.runner, models, spec, workers_by_default)
    if s.wrap is not None:
        decoder = s.wrap(decoder)
    decoder.cpu_layout = layout
    # The outermost decoder's counters are the run's (Jacobi's add their own to greedy's); the reporter
    # writes them at exit, which keeps it alive.
    StatsReporter(spec.search, decoder.stats, spec.stats_file)
    return decoder


def _capture_steps(runner, mode: str):
    """``--cuda-graphs``: the static-slot runner's step captured where ``mode`` turns it on (one-line errors)."""
    from fairseq_stream.runners.base import module_device
    from fairseq_stream.runners.step_graphs import enabled

    if enabled(mode, getattr(runner, "name", None), module_device(runner.model)):
        runner.use_cuda_graphs()


def cpu_layout_of(decoder):
    """The CPU layout :func:`build_decoder` set for ``decoder`` (workers, threads), or None."""
    return getattr(decoder, "cpu_layout", None)


def _lay_out_threads(runner, models, spec: DecoderSpec, workers_by_default: bool):
    """Our runners on the CPU: threads to our kernels, torch's ops on one (ops/threads.py says why); the
    layout, or None where the runner keeps torch's threads (and so one worker: said where more were asked)."""
    from fairseq_stream.ops.threads import apply_layout, choose_layout
    from fairseq_stream.runners import say_once
    from fairseq_stream.runners.own_step import OwnStepRunner

    on_cpu = all(p.device.type == "cpu" for m in models for p in m.parameters())
    # Every runner that runs its own step (lean, static, rnn) runs our kernels with torch's ops around them:
    # by class, not by name, so that a new one cannot keep torch's threads unnoticed, as the static-slot
    # runner did (its OpenMP regions were what issue 50's collapse was).
    if on_cpu and isinstance(runner, OwnStepRunner):
        layout = choose_layout(spec.cpu_threads, spec.cpu_workers, workers_by_default)
        if apply_layout(layout):
            return layout
    if spec.cpu_workers not in (None, 1):
        say_once("fairseq-stream: --cpu-workers %d is for our runners (lean, static, rnn) on the CPU with the "
                 "kernels built; this decode runs on one", spec.cpu_workers, level=logging.WARNING)
    return None


def _release_float_weights(runner, quantize: str):
    """Free the float weights the quantized products replace: the decoder built here owns the models
    (fairseq-generate's, the API's), and with a WMT'19 ensemble they are most of the process's memory."""
    freed = runner.release_float_weights()
    if freed:
        logger.info("fairseq-stream: --quantize %s: released %.0f MB of float weights the quantized products "
                    "replace (kept in float: embeddings, positions, layer norms, biases)", quantize, freed / 2 ** 20)


def workers_change_no_bit(scheduler, quantize: str) -> bool:
    """Whether CPU workers give one worker's bits under ``scheduler`` at ``quantize``, so that the default layout
    may take them (schedule/workers.py, tests/test_workers.py).

    Where each batch is decoded on its own, always. A stream across batches, split among workers, puts other
    sentences in its calls: float32 products then move in the last bits with the rows that share a call, but
    int8's are exact integer sums, row by row, in every width (``int8`` and its fixed forms ``int8w8`` and
    ``int8w7``), so there the workers give one worker's bits too (on the Multi30k model, int8 var-stream k=5 on
    two cores: two workers 1.90 s, one worker with two threads 2.31-2.36 s, docs/threads.md).
    """
    return not getattr(scheduler, "streams", False) or quantize in INT8_KINDS


def build_generator(spec: DecoderSpec, task, models, gen_cfg=None):
    """:func:`build_decoder`'s decoder on ``spec``'s scheduler: what fairseq's ``task.build_generator`` returns."""
    from fairseq_stream.interrupt import exit_on_ctrl_c
    from fairseq_stream.registry import GENERATOR_REGISTRY

    from fairseq_stream.schedule.workers import on_workers, one_batch_at_a_time

    scheduler = GENERATOR_REGISTRY[spec.scheduler]
    by_default = workers_change_no_bit(scheduler, spec.quantize) and not one_batch_at_a_time(gen_cfg)
    decoder = build_decoder(spec, task, models, workers_by_default=by_default)
    generator = scheduler.build(decoder, spec.scheduler_options, task, models, gen_cfg)
    exit_on_ctrl_c()  # in fairseq-generate and fairseq-interactive: one line and status 130
    return on_workers(generator, cpu_layout_of(decoder), task, models, gen_cfg)


class OurSearch:
    """A ``--search`` entry of ours: it says its :class:`SearchSettings`; building goes through this module.

    Subclasses set ``generators`` (the schedulers they run on),
    ``default_generator`` and :meth:`settings`.
    """

    default_generator = "batch"

    @classmethod
    def settings(cls, gen_cfg, search_cfg) -> SearchSettings:
        """Beam width, finalization, pruning and what wraps the decoder, from the parsed options."""
        raise NotImplementedError

    @classmethod
    def build(cls, task, models, gen_cfg, search_cfg, generator_cfg, fairseq_build):
        """What fairseq's ``task.build_generator`` returns for this search (``fairseq_build``: fairseq's own)."""
        return build_generator(spec_from_configs(cls, gen_cfg, search_cfg, generator_cfg), task, models, gen_cfg)
