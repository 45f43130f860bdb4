"""Reading raw input text: UTF-8 only, and a one-line error naming the line that is not.

fairseq-interactive reads its input through Python's text layer, which either
raises ``UnicodeDecodeError`` on a chunk of 8 KB (a traceback, pointing at no
line) or, under a C/POSIX locale, passes undecodable bytes on as lone
surrogates until sentencepiece fails on them. We decode line by line instead,
so that the error can say which line is wrong, and we refuse such lines
rather than replace their bytes: a silently altered sentence would be
translated as if it were the input.
"""

import sys
from typing import Iterator, List

from fairseq_stream.errors import FairseqStreamError

FIX_HINT = "re-encode the input as UTF-8 (e.g. iconv -f LATIN1 -t UTF-8, or iconv -c to drop bad bytes)"


def text_lines(text: str) -> List[str]:
    """The lines of ``text`` as Python's text mode splits them (universal newlines: ``\\n``, ``\\r\\n`` or a lone
    ``\\r`` ends a line), line ends removed."""
    parts = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    if parts[-1] == "":
        parts.pop()
    return parts


def read_lines(path: str) -> Iterator[str]:
    """The lines of ``path`` (``-``: standard input) as text, line ends removed.

    Lines split as Python's text mode splits them (``\\n``, ``\\r\\n`` or ``\\r``).

    Raises:
        FairseqStreamError: the file cannot be opened, or a line is not valid
            UTF-8 (its number is in the message).
    """
    try:
        stream = sys.stdin.buffer if path == "-" else open(path, "rb")
    except OSError as e:
        raise FairseqStreamError("cannot read input file {}: {}".format(path, e.strerror or e)) from None
    try:
        for number, raw in enumerate(stream, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise FairseqStreamError(
                    "input line {} is not valid UTF-8 (byte 0x{:02x} at byte offset {} of the line); {}"
                    .format(number, raw[e.start], e.start, FIX_HINT)) from None
            yield from text_lines(text)
    finally:
        if stream is not sys.stdin.buffer:
            stream.close()


def check_sentence(index: int, sentence) -> str:
    """``sentence`` if it is text that can be translated, else a one-line error naming ``index``."""
    if not isinstance(sentence, str):
        raise FairseqStreamError(
            "input sentence {} is a {}, not a str (decode bytes first, e.g. line.decode('utf-8'))"
            .format(index, type(sentence).__name__))
    try:
        sentence.encode("utf-8")
    except UnicodeEncodeError as e:
        # Lone surrogates: bytes that did not decode, kept by errors="surrogateescape".
        raise FairseqStreamError(
            "input sentence {} is not valid UTF-8 text (undecodable byte at character {}); {}"
            .format(index, e.start, FIX_HINT)) from None
    return sentence
