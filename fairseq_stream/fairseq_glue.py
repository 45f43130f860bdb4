"""Everything that touches fairseq's globals lives here, installed once at plugin import.

fairseq-fixed 0.12.3.1 with Hydra 1.3.2 needs these adjustments (see
``shared/DESIGN.md`` for how each was found):

* the ``--search`` / ``--generator`` registries are top-level config groups
  that fairseq's ``FairseqConfig`` does not know, so Hydra refuses
  ``search=NAME``; we store an extended primary schema and turn the group
  selection into ``+search=NAME``;
* ``task.build_generator`` is the one place fairseq-generate and
  fairseq-interactive build a decoder: we route it to the chosen search;
* ``data_utils.batch_by_size`` drops the last batch when its size is not a
  multiple of ``--required-batch-size-multiple``: every index must come out;
* ``checkpoint_utils.load_checkpoint_to_cpu`` calls ``torch.load`` with no
  allow-list, which fails on torch >= 2.6: we load with exactly the globals
  fairseq needs (``fairseq_stream.checkpoint``);
* ``checkpoint_utils.load_model_ensemble_and_task`` raises a bare IOError for
  a missing file: we name the file on one line first;
* ``options.parse_args_and_arch`` gets the ``--trust-checkpoint`` flag,
  expands ``--preset`` (:mod:`fairseq_stream.presets`) and checks that the chosen search and generator combine and that the
  generation options suit the search (before fairseq asserts on them);
* ``fairseq_cli.interactive.buffered_read`` decodes input line by line, so
  that a line that is not UTF-8 is a one-line error naming it, and
  ``make_batches`` names an over-long line by its number (fairseq: its index
  in the buffer) and announces a buffer's batches to ``--cpu-workers``;
* ``data.iterators.BackgroundConsumer``, fairseq's data-loading thread, is
  stopped and joined at exit (:mod:`fairseq_stream.exit_threads`): left
  running into the interpreter's finalization inside a torch operator, it
  aborted fairseq-generate after an error ("terminate called without an
  active exception");
* after ``task.build_generator`` the tools' output loops read the
  configuration about 22 times a sentence, each read through omegaconf's
  node machinery: the configuration remembers its reads until anything
  writes it (:mod:`fairseq_stream.config_reads`);
* ``data.Dictionary.string`` reads a token tensor element by element through
  tensor operators, three times a sentence in fairseq-generate: the same
  rules over the tensor's ``tolist`` (:mod:`fairseq_stream.token_strings`),
  the same strings, a tenth of the parent's CPU there; ``Dictionary.encode_line``
  (each target and hypothesis again for the BLEU scorer, each input line of
  fairseq-interactive) writes a tensor element by element: the ids go to a
  list first, the same tensor.

Each adjustment to a fairseq function, wrapped or replaced, is installed by :func:`_patch`;
preset expansion is :mod:`fairseq_stream.presets.resolve`, maxi-batching
:mod:`fairseq_stream.schedule.maxi_batch`.
"""

import functools
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import numpy as np

from fairseq_stream.errors import FairseqStreamError

logger = logging.getLogger(__name__)

# The mark of every function installed here (a second installation leaves it as it is).
PATCHED = "_fairseq_stream"


class Selection(NamedTuple):
    """The user's ``--search`` / ``--generator`` choice and their option groups."""

    search: Optional[str]
    search_cfg: Any
    generator: Optional[str]
    generator_cfg: Any


def install():
    """Apply every adjustment once; safe to call again."""
    if getattr(install, "done", False):
        return
    from fairseq_stream.errors import install_excepthook

    install_excepthook()  # first: fairseq's import below takes seconds, and Ctrl-C may land there
    _extend_config_schema()
    _patch_override_module_args()
    _patch_parse_args_and_arch()
    _patch_build_generator()
    _patch_batch_by_size()
    _patch_filter_indices_by_size()
    _patch_checkpoint_loading()
    _patch_interactive_input()
    _patch_background_consumer()
    _patch_dictionary_string()
    _patch_lstm_encoder()
    _patch_diverse_beam_search()
    install.done = True


def _patch(owner, name: str, replacement: Callable) -> Callable:
    """Install ``replacement(original, *args, **kwargs)`` as ``owner.name``, in place of fairseq's ``original``.

    The installed function carries the original's name and docstring and a
    mark: installing again (``install()`` twice, the plugin imported under two
    names) leaves the first installation in place. Returns what is installed;
    as a plain function it binds as a method where ``owner`` is a class.
    """
    original = getattr(owner, name)
    if getattr(original, PATCHED, False):
        return original

    @functools.wraps(original)
    def patched(*args, **kwargs):
        return replacement(original, *args, **kwargs)

    setattr(patched, PATCHED, True)
    setattr(owner, name, patched)
    return patched


# --- Hydra config ---------------------------------------------------------


def _extend_config_schema():
    from fairseq.dataclass.configs import FairseqConfig
    from hydra.core.config_store import ConfigStore

    @dataclass
    class FairseqStreamConfig(FairseqConfig):
        search: Any = None
        generator: Any = None

    ConfigStore.instance().store(name="config", node=FairseqStreamConfig)


def _patch_override_module_args():
    from fairseq.dataclass import utils as dc_utils

    def override_module_args(original, args):
        from fairseq_stream.registry import PLUGIN_GROUPS

        overrides, deletes = original(args)
        # ``search=NAME`` selects a config group missing from the primary
        # config's defaults list; Hydra only accepts that as an append.
        prefixes = tuple(group + "=" for group in PLUGIN_GROUPS)
        overrides = ["+" + o if o.startswith(prefixes) else o for o in overrides]
        return overrides, deletes

    _patch(dc_utils, "override_module_args", override_module_args)


# --- command line -----------------------------------------------------------


def _patch_parse_args_and_arch():
    from fairseq import options

    def parse_args_and_arch(original, parser, input_args=None, parse_known=False, **kwargs):
        import sys

        from fairseq_stream import presets

        # Registered for --help only: expand() takes every --preset out before parsing.
        _add_option_once(parser, presets.FLAG, action="append", metavar="NAME|FILE", help=presets.help_text())
        try:
            input_args = expand_presets(parser, sys.argv[1:] if input_args is None else input_args)
        except presets.PresetError as e:
            refuse(parser, str(e))
        _add_plugin_options(parser)
        _check_before_parsing(parser, input_args)
        result = original(parser, input_args=input_args, parse_known=parse_known, **kwargs)
        _check_after_parsing(parser, result[0] if parse_known else result, input_args)
        return result

    _patch(options, "parse_args_and_arch", parse_args_and_arch)


def refuse(parser, message: str):
    """Stop with argparse's error line and status 2, without its usage text first: fairseq-generate's usage
    is 140 to 230 lines, above the one line that says what is wrong."""
    parser.exit(2, "{}: error: {}\n".format(parser.prog, message))


def _add_option_once(parser, flag, **kwargs):
    """Add ``flag`` to the parser's fairseq-stream group unless it has it (parsers are built again and again)."""
    if not any(flag in a.option_strings for a in parser._actions):
        parser.add_argument_group("fairseq-stream").add_argument(flag, **kwargs)


def _add_plugin_options(parser):
    """``--trust-checkpoint`` and ``--maxi-batch``, the plugin's options outside any registry entry."""
    from fairseq_stream.checkpoint import TRUST_FLAG
    from fairseq_stream.schedule import maxi_batch

    _add_option_once(
        parser, TRUST_FLAG, action="store_true",
        help="load the --path checkpoints with the full unpickler even if they "
        "contain globals fairseq checkpoints do not need (only for files you trust)",
    )
    _add_option_once(parser, maxi_batch.FLAG, type=int, default=None, metavar="M", help=maxi_batch.HELP)


def _check_before_parsing(parser, input_args):
    """The chosen search's and generator's options for --help, and their names checked (``parser.error``)."""
    from fairseq_stream.registry import check_names, chosen_names

    _add_chosen_options_for_help(parser, input_args)
    chosen = chosen_names(input_args)
    # Checked before fairseq parses: some wrong combinations (a preset that
    # already includes its generator's options, plus --generator) would
    # otherwise fail inside argparse with a conflicting-option traceback,
    # and an unknown name is named as unknown, not as a bad combination.
    # (check_selection names unknown names first.)
    error = (check_selection(chosen.search, chosen.generator) if chosen.search in _search_registry()
             else check_names(chosen.search, chosen.generator)) or _search_option_without_search(
                 chosen.search, input_args)
    if error:
        refuse(parser, error)


def _check_after_parsing(parser, args, input_args):
    """Check the parsed selection and generation options, keep --maxi-batch, trust --trust-checkpoint's files."""
    error = check_selection(
        getattr(args, "search", None), getattr(args, "generator", None)
    ) or check_generation(getattr(args, "search", None), args) or _model_overrides_problem(args) or \
        _buffer_problem(args)
    if error:
        refuse(parser, error)
    _log_ignored_beam(args, input_args)
    _greedy_beam(args)
    _set_maxi_batch(parser, getattr(args, "maxi_batch", None))
    if getattr(args, "trust_checkpoint", False) and getattr(args, "path", None):
        from fairseq import utils
        from fairseq_stream.checkpoint import trust_checkpoints

        trust_checkpoints(utils.split_paths(args.path))


def _buffer_problem(args) -> Optional[str]:
    """fairseq-interactive's ``--batch-size`` above ``--buffer-size``, which it asserts after loading the
    model (a traceback); None elsewhere (only fairseq-interactive has ``--buffer-size``)."""
    if not hasattr(args, "buffer_size"):
        return None
    buffer, batch = max(args.buffer_size or 0, 1), getattr(args, "batch_size", None)  # fairseq: 0 is 1
    if batch and batch > buffer:
        return ("--batch-size {} cannot be larger than --buffer-size {} (the lines read at once; give "
                "--buffer-size {} or more)".format(batch, buffer, batch))
    return None


def _model_overrides_problem(args) -> Optional[str]:
    """What is wrong with ``--model-overrides``, which fairseq-generate reads with ``ast.literal_eval`` after
    loading the task (a SyntaxError traceback); None where it is a dict."""
    import ast

    text = getattr(args, "model_overrides", None)
    if not text:
        return None
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return "--model-overrides {!r} is not a Python dict literal, e.g. \"{{'max_source_positions': 2048}}\"".format(
            text)
    if not isinstance(value, dict):
        return "--model-overrides must be a dict, e.g. \"{{'max_source_positions': 2048}}\", got {!r}".format(text)
    return None


def _set_maxi_batch(parser, m):
    """Hand --maxi-batch to the batching patch (None: fairseq's order, the whole input sorted).

    fairseq passes no option of the command line down to ``batch_by_size``:
    the value is a setting of that patch, set on it at each parse.
    """
    from fairseq.data import data_utils
    from fairseq_stream.schedule import maxi_batch

    try:
        maxi_batch.check(m)
    except FairseqStreamError as e:
        refuse(parser, str(e))
    data_utils.batch_by_size.maxi_batch = m


def expand_presets(parser, argv):
    """``argv`` with its ``--preset`` options expanded before the typed ones (typed options win); the preset
    options a typed ``--search``/``--generator`` replaces are left out, with a log line
    (:func:`fairseq_stream.presets.resolve.resolve`)."""
    from fairseq_stream.presets.resolve import resolve

    argv, note = resolve(parser, argv)
    if note:
        logger.info(note)
    return argv


def _log_ignored_beam(args, argv):
    """Say so when a ``--beam`` that was given has no effect (greedy and Jacobi decode with one row)."""
    from fairseq_stream.plugin.common import ignored_beam_note

    search = getattr(args, "search", None)
    given = any(a == "--beam" or a.startswith("--beam=") for a in argv)
    if given and search in _search_registry():
        note = ignored_beam_note(search, _search_registry()[search], getattr(args, "beam", None))
        if note:
            logger.warning(note)


def _greedy_beam(args):
    """``--beam 1`` for a search that decodes greedily (greedy, Jacobi), so that what fairseq prints of the
    beam (fairseq-generate's "Generate test with beam=...: BLEU4 = ...") says what ran."""
    search = getattr(args, "search", None)
    if search in _search_registry() and not getattr(_search_registry()[search], "uses_beam", True):
        args.beam = 1


def _search_registry():
    from fairseq_stream.registry import SEARCH_REGISTRY

    return SEARCH_REGISTRY


def _add_chosen_options_for_help(parser, input_args):
    """Show the chosen entries' options in ``--help``.

    fairseq adds a registry entry's options only after a first parse, which
    ``--help`` ends before they exist; add them up front in that case only
    (otherwise fairseq adds them itself and a second copy would conflict).
    """
    from fairseq.dataclass.utils import gen_parser_from_dataclass
    from fairseq.registry import REGISTRIES

    from fairseq_stream.registry import PLUGIN_GROUPS, chosen_names

    if not any(a in ("-h", "--help") for a in input_args):
        return
    chosen = chosen_names(input_args)
    for group in PLUGIN_GROUPS:
        dataclass_registry = REGISTRIES[group]["dataclass_registry"]
        name = getattr(chosen, group)
        if name in dataclass_registry:
            gen_parser_from_dataclass(
                parser.add_argument_group("--{} {}".format(group, name)),
                dataclass_registry[name](),
            )


def _search_option_without_search(search, argv):
    """A one-line error for an option of our searches (``--quantize``, ``--runner`` ...) typed without one
    of them (no ``--search``, or ``--search beam``: fairseq's own generator, which takes none), else None.

    argparse would say "unrecognized arguments", which does not tell a user
    that the option needs one of our searches.
    """
    from fairseq_stream.registry import entry_options

    registry = _search_registry()
    if search is not None and not getattr(registry.get(search), "fairseq_generator", False):
        return None
    ours = set().union(*(entry_options("search", name) for name, entry in registry.items()
                         if not getattr(entry, "fairseq_generator", False))) - entry_options("search", search)
    typed = next((a.split("=", 1)[0] for a in argv if a.split("=", 1)[0] in ours), None)
    if typed is None:
        return None
    return ("{} is an option of fairseq-stream's searches, not of fairseq's beam search: use --search fixed "
            "(fairseq's beam search on our loop) or another of: {}".format(
                typed, ", ".join(n for n, e in registry.items() if not getattr(e, "fairseq_generator", False))))


def check_selection(search, generator):
    """Return a one-line error if ``--search``/``--generator`` are unknown or do not combine, else None."""
    from fairseq_stream.registry import SEARCH_REGISTRY, check_names

    unknown = check_names(search, generator)
    if unknown:
        return unknown
    if search is None:
        if generator is not None:
            return "--generator {} needs a --search policy (choose from {})".format(
                generator, ", ".join(sorted(SEARCH_REGISTRY))
            )
        return None
    search_cls = SEARCH_REGISTRY[search]
    allowed = search_cls.generators
    if generator is not None and getattr(search_cls, "includes_generator", False):
        return "--search {} already runs on --generator {} and takes its options; leave out " \
            "--generator (or use --search var --generator {})".format(search, allowed[0], allowed[0])
    if generator is not None and generator not in allowed:
        return "--search {} does not combine with --generator {} (valid: {})".format(
            search, generator, ", ".join(allowed)
        )
    return None


def check_generation(search, args):
    """A one-line error for generation options the chosen search cannot run, else None.

    Checked right after parsing, before fairseq's own assertions (``--sampling``
    needs ``--nbest`` = ``--beam``) or the decoder (``--beam 0``) fail deep inside.
    """
    from fairseq_stream.errors import FairseqStreamError
    from fairseq_stream.registry import SEARCH_DATACLASS_REGISTRY, SEARCH_REGISTRY
    from fairseq_stream.plugin.common import check_search_options

    if search is None or search not in SEARCH_REGISTRY:
        return None
    try:
        # The parsed command line is flat: it holds the generation, search
        # and stream options alike.
        check_search_options(search, SEARCH_REGISTRY[search], args,
                             SEARCH_DATACLASS_REGISTRY[search].from_namespace(args),
                             args if hasattr(args, "stream_eps") else None, getattr(args, "generator", None))
    except FairseqStreamError as e:
        return str(e)
    return None


# --- building the decoder -------------------------------------------------


def selection_of(gen_cfg) -> Selection:
    """Find the plugin choice that belongs to a generation config.

    fairseq passes only ``cfg.generation`` to ``build_generator``; the
    ``search``/``generator`` groups sit beside it in the same Hydra config, so
    we read them from its root. Legacy callers pass a flat Namespace.
    """
    from omegaconf import DictConfig

    from fairseq_stream.registry import (
        GENERATOR_DATACLASS_REGISTRY,
        SEARCH_DATACLASS_REGISTRY,
    )

    if isinstance(gen_cfg, DictConfig):
        root = gen_cfg._get_root()
        search_cfg = root.get("search") if "search" in root else None
        generator_cfg = root.get("generator") if "generator" in root else None
        return Selection(
            search_cfg._name if search_cfg is not None else None,
            search_cfg,
            generator_cfg._name if generator_cfg is not None else None,
            generator_cfg,
        )
    search = getattr(gen_cfg, "search", None)
    generator = getattr(gen_cfg, "generator", None)
    return Selection(
        search,
        _named(SEARCH_DATACLASS_REGISTRY[search].from_namespace(gen_cfg), search) if search else None,
        generator,
        _named(GENERATOR_DATACLASS_REGISTRY[generator].from_namespace(gen_cfg), generator)
        if generator
        else None,
    )


def _named(cfg, name):
    """``cfg`` with ``_name`` set, as fairseq's parser sets it (errors and schedulers read it)."""
    cfg._name = name
    return cfg


def _patch_build_generator():
    from fairseq.tasks.fairseq_task import FairseqTask

    def build_generator(original, self, models, args, *rest, **kwargs):
        generator = _build_chosen_generator(original, self, models, args, *rest, **kwargs)
        # The tools' output loops come next and read the configuration ~22 times a sentence.
        from fairseq_stream.config_reads import remember_reads

        remember_reads(args)
        return generator

    _patch(FairseqTask, "build_generator", build_generator)


def _build_chosen_generator(original, task, models, args, *rest, **kwargs):
    """The chosen search's generator, or fairseq's own where no ``--search`` of ours is chosen."""
    fairseq_build = functools.partial(original, task, models, args, *rest, **kwargs)
    chosen = selection_of(args)
    if chosen.search is None:
        return fairseq_build()
    from fairseq_stream.registry import SEARCH_REGISTRY

    error = check_selection(chosen.search, chosen.generator)
    if error:
        raise FairseqStreamError(error)
    search_cls = SEARCH_REGISTRY[chosen.search]
    return search_cls.build(task, models, args, chosen.search_cfg, chosen.generator_cfg, fairseq_build)


# --- data -----------------------------------------------------------------


def _patch_batch_by_size():
    from fairseq.data import data_utils

    from fairseq_stream.schedule import maxi_batch

    def batch_by_size(original, indices, *args, **kwargs):
        if not isinstance(indices, np.ndarray):
            indices = np.fromiter(indices, dtype=np.int64, count=-1)
        if installed.maxi_batch is not None:
            indices = maxi_batch.reordered(indices, installed.maxi_batch, kwargs.get("max_sentences"))
        try:
            batches = list(original(indices, *args, **kwargs))
        except AssertionError as e:
            # fairseq's compiled batching asserts "Sentences lengths should not exceed max_tokens=N"
            if "max_tokens" not in str(e):
                raise
            from fairseq_stream.errors import FairseqStreamError

            raise FairseqStreamError(
                "an input is longer than --max-tokens allows (fairseq: {}); raise --max-tokens to "
                "the longest input's length or more, or give --batch-size instead".format(
                    str(e).strip().rstrip("!."))) from None
        covered = sum(len(b) for b in batches)
        if covered < len(indices):
            # fairseq-fixed drops a last batch whose size is not a multiple of
            # --required-batch-size-multiple; generation must see every input.
            seen = np.concatenate(batches) if batches else np.empty(0, dtype=np.int64)
            rest = indices[~np.isin(indices, seen)]
            batches.append(rest.astype(np.int64))
        return batches

    installed = _patch(data_utils, "batch_by_size", batch_by_size)
    # --maxi-batch, set at each parse (_set_maxi_batch); None: fairseq's order.
    installed.maxi_batch = getattr(installed, "maxi_batch", None)


class OverLongInput(FairseqStreamError):
    """fairseq's "Size of sample #N is invalid" as a one-line error; ``index`` (N) and ``length`` (its source
    tokens, EOS included) for fairseq-interactive to name the input line."""

    def __init__(self, error: Exception, dataset, max_positions):
        self.index = int(str(error)[len("Size of sample #"):].split()[0])
        sizes = getattr(dataset, "src_sizes", None)
        self.length = int(sizes[self.index]) if sizes is not None else None
        self.limit = max_positions[0] if isinstance(max_positions, tuple) else max_positions
        # fairseq's words, with plain numbers where it printed numpy's reprs ("(np.int32(17), np.int32(17))").
        super().__init__("an input is longer than the model's positions: sentence {} is {} tokens long (EOS "
                         "included; source, target), the model takes {}; skip such inputs with "
                         "--skip-invalid-size-inputs-valid-test".format(self.index, _plain(dataset.size(self.index)),
                                                                         _plain(max_positions)))


def _plain(value) -> str:
    """A size or a tuple of sizes as plain integers: ``17`` or ``(17, 17)``."""
    if isinstance(value, (tuple, list)):
        return "({})".format(", ".join(_plain(v) for v in value))
    return str(value) if value is None else str(int(value))


def _patch_filter_indices_by_size():
    """Over-long inputs: fairseq's behaviour, as a one-line error or an explicit warning."""
    from fairseq.tasks.fairseq_task import FairseqTask

    warned = set()

    def filter_indices_by_size(original, self, indices, dataset, max_positions=None, ignore_invalid_inputs=False):
        try:
            kept = original(self, indices, dataset, max_positions, ignore_invalid_inputs)
        except Exception as e:  # fairseq raises a bare Exception here
            if not str(e).startswith("Size of sample #"):
                raise
            raise OverLongInput(e, dataset, max_positions) from None
        dropped = len(indices) - len(kept)
        # The streaming generator's read-ahead filters the same dataset again: warn once.
        key = (id(dataset), dropped)
        if dropped and key not in warned:
            warned.add(key)
            logger.warning(
                "fairseq-stream: %d input sentence(s) exceed the model's positions (%s) and get "
                "NO output line (--skip-invalid-size-inputs-valid-test); shorten or split them "
                "to translate every input", dropped, max_positions,
            )
        return kept

    _patch(FairseqTask, "filter_indices_by_size", filter_indices_by_size)


def _patch_interactive_input():
    """fairseq-interactive reads its input line by line as UTF-8, naming a line that is not (or is too long)."""
    from fairseq_cli import interactive

    from fairseq_stream.text_input import read_lines

    # Input lines read before the current buffer (fairseq numbers a buffer's lines from 0): kept by
    # buffered_read, read by make_batches.
    position = _LinesRead()

    def buffered_read(original, input, buffer_size):
        position.before_buffer = 0
        buffer = []
        for line in read_lines(input):
            buffer.append(line.strip())
            if len(buffer) >= buffer_size:
                yield buffer
                position.before_buffer += len(buffer)
                buffer = []
        if buffer:
            yield buffer

    def make_batches(original, lines, *args, **kwargs):
        # An over-long input line is named by its number in the input (fairseq: "sample #0" of its buffer).
        from fairseq_stream.schedule.workers import announce

        try:
            # The buffer's batches at once (fairseq prints none of them before all are translated), so that
            # --cpu-workers can decode them at once (schedule/workers.py).
            batches = list(original(lines, *args, **kwargs))
        except OverLongInput as e:
            raise FairseqStreamError(
                "input line {} is longer than the model's positions: {} tokens (EOS included), at most {}; "
                "shorten or split it, or skip such lines with --skip-invalid-size-inputs-valid-test"
                .format(position.before_buffer + e.index + 1, e.length, e.limit)) from None
        announce([{"net_input": {"src_tokens": b.src_tokens, "src_lengths": b.src_lengths}} for b in batches])
        yield from batches

    _patch(interactive, "buffered_read", buffered_read)
    _patch(interactive, "make_batches", make_batches)


class _LinesRead:
    """How many input lines fairseq-interactive read before the buffer it is batching."""

    before_buffer = 0


def _patch_background_consumer():
    """fairseq's data-loading thread stops between batches when asked, and is asked at exit."""
    from fairseq.data import iterators

    from fairseq_stream.exit_threads import join_at_exit

    def __init__(original, self, batches, source, *args, **kwargs):
        stop = threading.Event()
        original(self, batches, _until(stop, source), *args, **kwargs)
        join_at_exit(self, functools.partial(_stop_consumer, stop, batches))

    _patch(iterators.BackgroundConsumer, "__init__", __init__)


def _until(stop: threading.Event, source):
    """``source``'s items until ``stop`` is set (checked before each item is fetched)."""
    items = iter(source)
    while not stop.is_set():
        try:
            item = next(items)
        except StopIteration:
            return
        yield item


def _stop_consumer(stop: threading.Event, batches: queue.Queue):
    stop.set()
    # At exit nobody reads the queue: emptied, it takes the consumer's last batch and its end mark,
    # so that the consumer returns instead of waiting on a full queue.
    while True:
        try:
            batches.get_nowait()
        except queue.Empty:
            return


# --- token strings --------------------------------------------------------


def _patch_dictionary_string():
    from fairseq.data.dictionary import Dictionary

    from fairseq_stream.token_strings import dictionary_encode_line, dictionary_string

    _patch(Dictionary, "string", dictionary_string)
    _patch(Dictionary, "encode_line", dictionary_encode_line)


def _patch_lstm_encoder():
    """fairseq's LSTM encoder on sources without a ``<pad>`` inside a sentence (:mod:`.inner_padding`)."""
    from fairseq.models.lstm import LSTMEncoder

    from fairseq_stream.inner_padding import without_inner_padding

    def forward(original, self, src_tokens, src_lengths, *args, **kwargs):
        tokens, lengths = without_inner_padding(src_tokens, self.padding_idx, self.left_pad)
        if tokens is not src_tokens:
            src_lengths = lengths.to(src_lengths.dtype)
        return original(self, tokens, src_lengths, *args, **kwargs)

    _patch(LSTMEncoder, "forward", forward)


def _patch_diverse_beam_search():
    """fairseq 0.12's diverse beam search (``--diverse-beam-groups``) on any batch, not the first alone.

    It keeps each sentence's group overlap in a tensor of the batch's rows
    but indexes it by the sentences' ids, so fairseq-generate failed with an
    IndexError at the second step of a batch whose ids pass its size (every
    batch but, by chance, the first). Here the ids become the rows they had
    at the batch's first step; where the ids are those rows (0..bsz-1) the
    result is fairseq's own.
    """
    import torch
    from fairseq.search import DiverseBeamSearch

    def step(original, self, step, lprobs, scores, prev_output_tokens=None, original_batch_idxs=None):
        if original_batch_idxs is not None:
            if step == 0:  # the batch's rows by sentence id, once a batch
                first = original_batch_idxs
                self._row_of_id = first.new_full((int(first.max()) + 1,), -1)
                self._row_of_id[first] = torch.arange(first.numel(), device=first.device, dtype=first.dtype)
            original_batch_idxs = self._row_of_id[original_batch_idxs]
        return original(self, step, lprobs, scores, prev_output_tokens, original_batch_idxs)

    _patch(DiverseBeamSearch, "step", step)


# --- checkpoints ----------------------------------------------------------


def _patch_checkpoint_loading():
    from fairseq import checkpoint_utils

    from fairseq_stream.checkpoint import check_readable, load_checkpoint_to_cpu, size_mismatch_error

    def load_checkpoint_to_cpu_safely(original, *args, **kwargs):
        # Ours in place of fairseq's, not around it: fairseq's torch.load with no allow-list fails on torch >= 2.6.
        return load_checkpoint_to_cpu(*args, **kwargs)

    def load_model_ensemble_and_task(original, filenames, arg_overrides=None, task=None, strict=True,
                                     suffix="", num_shards=1, state=None):
        # fairseq raises a bare IOError (a traceback) for a missing file: say
        # which file is wrong, on one line, before anything is loaded.
        if state is None:
            for filename in filenames:
                for shard in range(max(num_shards, 1)):
                    name = checkpoint_utils.get_maybe_sharded_checkpoint_filename(
                        filename, suffix, shard, num_shards)
                    if "://" not in name:
                        check_readable(name)
        try:
            return original(filenames, arg_overrides=arg_overrides, task=task, strict=strict,
                            suffix=suffix, num_shards=num_shards, state=state)
        except RuntimeError as error:
            # torch's dozens of "size mismatch" lines, most often a data directory of other dictionaries.
            one_line = size_mismatch_error(error, filenames)
            if one_line is None:
                raise
            raise one_line from None

    _patch(checkpoint_utils, "load_checkpoint_to_cpu", load_checkpoint_to_cpu_safely)
    _patch(checkpoint_utils, "load_model_ensemble_and_task", load_model_ensemble_and_task)
