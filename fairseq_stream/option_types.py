"""Option values checked by the type their field declares: one checker for the Python API and bulk's ``--option``.

Each option is a field of fairseq's generation options, the stream options
or the search's own (the Translator's own arguments: its signature), and its
value is checked against that field's type before any checkpoint loads, so
``lenpen="abc"`` is a one-line error naming the option and the value instead
of a TypeError deep inside the search.

The rule, the same for both:

* a value of the declared type is taken as it is; an int where a float is
  declared becomes that float (``lenpen=1`` and ``lenpen=1.0`` are one
  setting, the same chunks on a bulk re-run);
* a string is read as the command line reads it: ``beam="5"`` is 5,
  ``max_len_a="1.2"`` is 1.2, ``"true"``/``"false"`` (``yes``/``no``, ``1``/``0``)
  a flag, ``"none"`` an optional option's None; bulk's ``--option`` texts
  are such strings;
* anything else is refused: ``beam=2.5`` (a float for an integer),
  ``lenpen=None`` (None where the option is not optional), ``True`` for a
  number, a list. ``nbest`` must also be at least 1.
"""

import dataclasses
import enum
import numbers
import operator
import os
import typing
from typing import Dict

from fairseq_stream.errors import FairseqStreamError

TRUE, FALSE = ("true", "yes", "1"), ("false", "no", "0")
# Lowest values where the type alone lets through a value that fails deep inside (nbest=0 kept no hypothesis).
MINIMUM = {"nbest": 1}
_WHAT = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def fields(search: str, name: str = "search") -> Dict[str, object]:
    """{option: type} of ``search``'s options, the stream options and fairseq's generation options.

    ``name``: how a bad ``search`` is named in the error (``--search`` on a command line).
    """
    # The searches are registered: importing this module ran the package's __init__.
    from fairseq.dataclass.configs import GenerationConfig

    from fairseq_stream.registry import SEARCH_DATACLASS_REGISTRY
    from fairseq_stream.schedule.stream import StreamOptions

    if not isinstance(search, str) or search not in SEARCH_DATACLASS_REGISTRY or search == "beam":
        raise FairseqStreamError("{} must be one of {} (got {!r})".format(
            name, ", ".join(sorted(n for n in SEARCH_DATACLASS_REGISTRY if n != "beam")), search))
    out = {}
    for cls in (GenerationConfig, StreamOptions, SEARCH_DATACLASS_REGISTRY[search]):
        hints = typing.get_type_hints(cls)
        out.update({f.name: hints.get(f.name, f.type) for f in dataclasses.fields(cls) if not f.name.startswith("_")})
    return out


def typed(key: str, value, kind, prefix: str = ""):
    """``value`` of option ``key`` as ``kind`` (int, float, bool, str, a fairseq choice, Optional of one).

    ``prefix`` starts the error line (bulk's ``--option KEY=VALUE: ``).

    Raises:
        FairseqStreamError: the value does not fit the type (or ``MINIMUM``);
            the message names the option and the value.
    """
    args = typing.get_args(kind)
    optional = typing.get_origin(kind) is typing.Union and type(None) in args
    if optional:
        if value is None or (isinstance(value, str) and value.strip().lower() == "none"):
            return None
        kind = next(a for a in args if a is not type(None))
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return _choice(key, value, kind, prefix)
    if kind not in _WHAT:
        return value  # a type no option of ours has (Any): fairseq's own checks see it
    try:
        out = _convert(value, kind)
    except (TypeError, ValueError):
        raise FairseqStreamError("{}{} takes {}{}, got {!r}".format(
            prefix, key, _WHAT[kind], " or None" if optional else "", value)) from None
    if key in MINIMUM and out < MINIMUM[key]:
        raise FairseqStreamError("{}{} must be at least {}, got {!r}".format(prefix, key, MINIMUM[key], value))
    return out


def _convert(value, kind):
    """``value`` as ``kind`` by the rule of the module's docstring; TypeError or ValueError where it does not fit."""
    if isinstance(value, str):
        if kind is bool:
            if value.strip().lower() not in TRUE + FALSE:
                raise ValueError(value)
            return value.strip().lower() in TRUE
        return kind(value)  # int("5"), float("1.2"), the str itself; int("2.5") is a ValueError
    if isinstance(value, bool):
        if kind is bool:
            return value
        raise TypeError(value)  # True is an int to Python, never a number or a text to an option
    if kind is int:
        return operator.index(value)  # ints (numpy's too), never a float
    if kind is float and isinstance(value, numbers.Real):
        return float(value)
    if kind is str and isinstance(value, os.PathLike):
        return _text(os.fspath(value))
    if kind is str and isinstance(value, numbers.Real):
        return str(value)  # stream_eps=0.25 (the command line's text "0.25"); Fraction(1, 4) is "1/4"
    raise TypeError(value)


def _text(value):
    if not isinstance(value, str):
        raise TypeError(value)  # a path of bytes
    return value


def _choice(key: str, value, kind, prefix: str) -> str:
    """``value`` (its text, or a member of the choice) if it is one of ``kind``'s choices."""
    choices = [str(c.value) for c in kind]
    text = value.value if isinstance(value, enum.Enum) else value
    if not isinstance(text, str) or text not in choices:
        raise FairseqStreamError("{}{} must be one of {}, got {!r}".format(prefix, key, ", ".join(choices), value))
    return text
