"""``--option KEY=VALUE`` of ``fairseq-stream-bulk``: checked and typed before any work starts.

Each value is converted to the type of the search, stream or generation
option it names (fairseq's dataclass fields) by the rule the Python API's
keywords follow too (:mod:`fairseq_stream.option_types`), so ``lenpen=abc``
is a one-line error naming the option instead of a TypeError deep inside
the search, and ``lenpen=1`` and ``lenpen=1.0`` are the same setting (the
same chunks on a re-run). Options that have a flag of their own (``beam``,
``search``, ``pool`` ...) are refused with the flag to use instead.
"""

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
    from fairseq_stream.option_types import fields as option_fields
    from fairseq_stream.option_types import typed

    fields = option_fields(search, "--search")
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
        out[key] = typed(key, value, fields[key], prefix="--option {}: ".format(text))
    return out


def check_nbest(options: Dict[str, object], fmt: str, beam: int):
    """``nbest`` > 1 needs ``--format generate`` (the other formats give exactly one line per input line)."""
    nbest = options.get("nbest", 1)  # at least 1: checked with its type (option_types.MINIMUM)
    if nbest > beam:
        raise FairseqStreamError("--option nbest={}: nbest must not exceed --beam ({})".format(nbest, beam))
    if nbest > 1 and fmt != "generate":
        raise FairseqStreamError(
            "--option nbest={}: --format {} writes one line per input line; give --format generate for "
            "every hypothesis (H- lines)".format(nbest, fmt))
