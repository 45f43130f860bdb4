"""``--preset NAME|FILE``: a file of fairseq-generate options, expanded as if typed.

The presets shipped in this directory (``NAME.args``) hold the papers'
settings for every method; a path to any such file works too. A value is a
path when it contains a ``/`` or ends in ``.args``, else it names a shipped
preset: a file called ``greedy`` in the working directory does not replace
the shipped ``greedy`` (give ``./greedy`` for that). A preset's options are
placed before the options typed on the command line, so where both set an
option the typed one wins (argparse keeps the last value). Several
``--preset`` options expand in the order given. A flag a preset turns on
(``store_true``) cannot be turned off by a typed option.

File format: options as on a command line, split with shell quoting rules
(one per line or several on a line); ``#`` starts a comment.
"""

import os
import shlex
from typing import Dict, List, NamedTuple, Optional, Sequence, Set, Tuple

FLAG = "--preset"
SUFFIX = ".args"
HERE = os.path.dirname(os.path.abspath(__file__))


class PresetError(ValueError):
    """A preset that does not exist or cannot be read; the message is one line."""


def names() -> List[str]:
    """The shipped presets' names, sorted."""
    return sorted(f[: -len(SUFFIX)] for f in os.listdir(HERE) if f.endswith(SUFFIX))


# Presets that add to a method rather than being one: the GPU batch sizes, the CPU precisions.
ADD_ON_PREFIXES = ("gpu", "cpu-")


def method_names() -> List[str]:
    """The shipped presets that are decoding methods (not an add-on such as ``gpu32gb-k5`` or ``cpu-int8``)."""
    return [n for n in names() if not n.startswith(ADD_ON_PREFIXES)]


def is_path(value: str) -> bool:
    """Whether a ``--preset`` value is a file path (it has a ``/`` or ends in ``.args``) rather than a name."""
    return "/" in value or os.sep in value or value.endswith(SUFFIX)


def path_of(name: str) -> str:
    """The file a preset name or path refers to.

    A shipped name always means the shipped preset, whatever files the
    working directory holds: a command line that names ``greedy`` must not
    change meaning with the directory it runs in. Only a value that looks
    like a path (:func:`is_path`) is read from the file system.
    """
    if is_path(name):
        if os.path.isfile(name):
            return name
        raise PresetError("{} {!r}: no such file (presets: {})".format(FLAG, name, ", ".join(names())))
    shipped = os.path.join(HERE, name + SUFFIX)
    if os.path.isfile(shipped):
        return shipped
    hint = "; for the file, give its path: --preset ./{}".format(name) if os.path.isfile(name) else ""
    raise PresetError("{} {!r}: no such file and no such preset (presets: {}){}".format(
        FLAG, name, ", ".join(names()), hint))


def options_of(name: str) -> List[str]:
    """The options a preset holds, in file order."""
    path = path_of(name)
    try:
        with open(path, encoding="utf-8") as f:
            options = shlex.split(f.read(), comments=True)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise PresetError("{} {}: cannot read it: {}".format(FLAG, path, e)) from None
    if any(o == FLAG or o.startswith(FLAG + "=") for o in options):
        # One level keeps precedence obvious: the order on the command line is the order of expansion.
        raise PresetError("{} {}: a preset cannot name another preset; give both on the command line"
                          .format(FLAG, path))
    return options


def expand(argv: Sequence[str]) -> List[str]:
    """``argv`` with every ``--preset X`` removed and the presets' options put first.

    Raises :class:`PresetError` for an unknown preset or a ``--preset`` without a value.
    """
    preset_options, typed = split(argv)
    return preset_options + typed if preset_options is not None else list(argv)


def split(argv: Sequence[str]) -> Tuple[Optional[List[str]], List[str]]:
    """(the presets' options in order, the typed options without ``--preset``); None first if no preset."""
    chosen, rest = [], []
    args = iter(argv)
    for arg in args:
        if arg == FLAG:
            value = next(args, None)
            if value is None or value.startswith("--"):
                raise PresetError("{} needs a name or a file (presets: {})".format(FLAG, ", ".join(names())))
            chosen.append(value)
        elif arg.startswith(FLAG + "="):
            chosen.append(arg[len(FLAG) + 1:])
        else:
            rest.append(arg)
    if not chosen:
        return None, list(argv)
    expanded = []
    for name in chosen:
        expanded.extend(options_of(name))
    return expanded, rest


class Arity(NamedTuple):
    """What the parser does with an option: ``key`` names its destination, ``value`` says it takes one."""

    key: str
    value: bool


def _items(options: Sequence[str], arity: Dict[str, Arity]):
    """``options`` cut into (Arity or None, tokens): an option with its value, or one token we leave alone.

    Only options with a known arity are paired with their value; a value
    that starts with ``--`` is not taken (argparse would refuse it), so the
    tokens pass through unchanged for argparse to judge.
    """
    i = 0
    while i < len(options):
        token = options[i]
        flag, eq, _ = token.partition("=")
        known = arity.get(flag) if token.startswith("--") else None
        if known is None or (eq and not known.value):
            yield None, options[i:i + 1]
            i += 1
        elif eq or not known.value:
            yield known, options[i:i + 1]
            i += 1
        elif i + 1 < len(options) and not options[i + 1].startswith("--"):
            yield known, options[i:i + 2]
            i += 2
        else:
            yield None, options[i:i + 1]
            i += 1


def last_of_each(options: Sequence[str], arity: Dict[str, Arity]) -> List[str]:
    """``options`` with only the last occurrence of each single-valued option, each where it was.

    argparse keeps the last value of such an option, so the earlier ones
    change nothing; but argparse's parsing takes time quadratic in the
    number of options given (Python 3.11's ``_parse_known_args`` looks for
    the next option among all of them at each one): a 200,000-line preset
    took minutes. Aliases share a key (``--batch-size``, ``--max-sentences``).
    """
    items = list(_items(options, arity))
    last = {a.key: i for i, (a, _) in enumerate(items) if a is not None}
    return [t for i, (a, tokens) in enumerate(items) if a is None or last[a.key] == i for t in tokens]


def without(options: Sequence[str], flags: Set[str], arity: Dict[str, Arity]) -> Tuple[List[str], List[str]]:
    """(``options`` without the options in ``flags`` and their values, the tokens taken out)."""
    kept, dropped = [], []
    for known, tokens in _items(options, arity):
        flag = tokens[0].partition("=")[0]
        (dropped if known is not None and flag in flags else kept).extend(tokens)
    return kept, dropped


def help_text() -> str:
    """The ``--preset`` line of ``--help``."""
    return ("expand the options of a preset as if typed before the others (typed options win); "
            "repeatable; a file of options or one of: " + ", ".join(names()))
