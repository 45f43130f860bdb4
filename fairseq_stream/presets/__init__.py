"""``--preset NAME|FILE``: a file of fairseq-generate options, expanded as if typed.

The presets shipped in this directory (``NAME.args``) hold the papers'
settings for every method; a path to any such file works too. A preset's
options are placed before the options typed on the command line, so where
both set an option the typed one wins (argparse keeps the last value).
Several ``--preset`` options expand in the order given. A flag a preset
turns on (``store_true``) cannot be turned off by a typed option.

File format: options as on a command line, split with shell quoting rules
(one per line or several on a line); ``#`` starts a comment.
"""

import os
import shlex
from typing import List, Sequence

FLAG = "--preset"
SUFFIX = ".args"
HERE = os.path.dirname(os.path.abspath(__file__))


class PresetError(ValueError):
    """A preset that does not exist or cannot be read; the message is one line."""


def names() -> List[str]:
    """The shipped presets' names, sorted."""
    return sorted(f[: -len(SUFFIX)] for f in os.listdir(HERE) if f.endswith(SUFFIX))


def path_of(name: str) -> str:
    """The file a preset name or path refers to (a path that exists wins over a name)."""
    if os.path.isfile(name):
        return name
    shipped = os.path.join(HERE, name + SUFFIX)
    if os.path.isfile(shipped):
        return shipped
    raise PresetError("{} {!r}: no such file and no such preset (presets: {})".format(
        FLAG, name, ", ".join(names())))


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
        return list(argv)
    expanded = []
    for name in chosen:
        expanded.extend(options_of(name))
    return expanded + rest


def help_text() -> str:
    """The ``--preset`` line of ``--help``."""
    return ("expand the options of a preset as if typed before the others (typed options win); "
            "repeatable; a file of options or one of: " + ", ".join(names()))
