"""``--option KEY=VALUE`` of ``fairseq-stream-bulk``: checked and typed before any work starts.

Each value is converted to the type of the search, stream or generation
option it names (fairseq's dataclass fields), so ``lenpen=abc`` is a one-line
error naming the option instead of a TypeError deep inside the search, and
``lenpen=1`` and ``lenpen=1.0`` are the same setting (the same chunks on a
re-run). Options that have a flag of their own (``beam``, ``search``,
``pool`` ...) are refused with the flag to use instead.
"""

import dataclasses
import enum
import typing
from typing import Dict, List, Tuple

from fairseq_stream.errors import FairseqStreamError

# Translator arguments that the bulk command sets from flags of its own: giving one
# again as --option made Translator(...) fail with "got multiple values".
OWN_FLAGS = {
    "paths": "--path", "path": "--path", "data": "--data", "search": "--search", "beam": "--beam",
    "pool": "--pool", "stream_pool": "--pool", "batch_size": "--batch-size", "maxi_batch": "--maxi-batch",
    "bpe": "--bpe", "tokenizer": "--tokenizer", "sentencepiece_model": "--sentencepiece-model",
    "bpe_codes": "--bpe-codes", "cpu": "--cpu", "trust_checkpoint": "--trust-checkpoint",
}

_TRUE, _FALSE = ("true", "yes", "1"), ("false", "no", "0")


def split(text: str) -> Tuple[str, str]:
    """``KEY=VALUE`` -> (key with ``-`` as ``_``, the value's text)."""
    if "=" not in text:
        raise FairseqStreamError("--option takes KEY=VALUE, got {!r}".format(text))
    key, value = text.split("=", 1)
    return key.strip().replace("-", "_"), value.strip()


def checked(search: str, options: List[str]) -> Dict[str, object]:
    """The ``--option`` texts as {name: typed value}, for ``search``.

    Raises:
        FairseqStreamError: a malformed, unknown, repeated or badly typed
            option, or one with a flag of its own; the message names it.
    """
    from fairseq_stream.api import COMMAND_LINE_ONLY

    fields = _fields(search)
    out = {}
    for text in options:
        key, value = split(text)
        if key in OWN_FLAGS:
            raise FairseqStreamError("--option {}: use {} instead".format(text, OWN_FLAGS[key]))
        if key in COMMAND_LINE_ONLY:
            raise FairseqStreamError("--option {}: no effect in bulk translation: {}".format(
                text, COMMAND_LINE_ONLY[key]))
        if key in out:
            raise FairseqStreamError("--option {} given twice".format(key))
        if key not in fields:
            raise FairseqStreamError("--option {}: unknown option {!r} for --search {}".format(text, key, search))
        out[key] = _typed(text, key, value, fields[key])
    return out


def _fields(search: str) -> Dict[str, object]:
    """{field name: type} of the search's options, the stream options and fairseq's generation options."""
    import fairseq_stream  # noqa: F401  (registers the searches)
    from fairseq.dataclass.configs import GenerationConfig

    from fairseq_stream.registry import SEARCH_DATACLASS_REGISTRY
    from fairseq_stream.schedule.stream import StreamOptions

    if search not in SEARCH_DATACLASS_REGISTRY or search == "beam":
        raise FairseqStreamError("--search must be one of {} (got {!r})".format(
            ", ".join(sorted(n for n in SEARCH_DATACLASS_REGISTRY if n != "beam")), search))
    fields = {}
    for cls in (GenerationConfig, StreamOptions, SEARCH_DATACLASS_REGISTRY[search]):
        hints = typing.get_type_hints(cls)
        fields.update({f.name: hints.get(f.name, f.type) for f in dataclasses.fields(cls)
                       if not f.name.startswith("_")})
    return fields


def _typed(text: str, key: str, value: str, kind):
    """``value`` converted to ``kind`` (int, float, bool, str, a fairseq choice, Optional of one)."""
    args = typing.get_args(kind)
    if typing.get_origin(kind) is typing.Union and type(None) in args:
        if value.lower() == "none":
            return None
        kind = next(a for a in args if a is not type(None))
    try:
        if kind is bool:
            if value.lower() in _TRUE + _FALSE:
                return value.lower() in _TRUE
            raise ValueError
        if kind is int:
            return int(value)
        if kind is float:
            return float(value)
        if isinstance(kind, type) and issubclass(kind, enum.Enum):
            choices = [str(c.value) for c in kind]
            if value not in choices:
                raise FairseqStreamError("--option {}: {} must be one of {}".format(text, key, ", ".join(choices)))
            return value
    except ValueError:
        raise FairseqStreamError("--option {}: {} takes {}, got {!r}".format(
            text, key, {bool: "true or false", int: "an integer", float: "a number"}[kind], value)) from None
    return value  # str, or a type this command does not know: fairseq's own checks see the text


def check_nbest(options: Dict[str, object], fmt: str, beam: int):
    """``nbest`` > 1 needs ``--format generate`` (the other formats give exactly one line per input line)."""
    nbest = options.get("nbest", 1)
    if nbest < 1:
        raise FairseqStreamError("--option nbest={}: nbest must be at least 1".format(nbest))
    if nbest > beam:
        raise FairseqStreamError("--option nbest={}: nbest must not exceed --beam ({})".format(nbest, beam))
    if nbest > 1 and fmt != "generate":
        raise FairseqStreamError(
            "--option nbest={}: --format {} writes one line per input line; give --format generate for "
            "every hypothesis (H- lines)".format(nbest, fmt))
