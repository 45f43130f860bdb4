"""A test set's source and reference lines: local plain text, or sacreBLEU's copy of WMT's."""

import os
import subprocess
import sys
from dataclasses import dataclass
from typing import List, Optional

from fairseq_stream import text_input
from fairseq_stream.errors import FairseqStreamError
from fairseq_stream.newstest import NewstestError


class CorpusError(NewstestError):
    """The test set cannot be found or read; the message is one line."""


@dataclass
class Corpus:
    """Raw (untokenized) source and reference lines of one test set."""

    name: str
    source: List[str]
    reference: List[str]
    origin: str  # where the lines came from, for the results file


def read_lines(path: str) -> List[str]:
    """One sentence per line, UTF-8, read as every input of this project is (:mod:`fairseq_stream.text_input`)."""
    try:
        return list(text_input.read_lines(path))
    except FairseqStreamError as e:
        # "cannot read input file PATH" names it already; a bad line's message does not.
        raise CorpusError(str(e) if path in str(e) else "{}: {}".format(path, e)) from None


def load(pair: str, year: str, text_dir: Optional[str] = None, source: Optional[str] = None,
         reference: Optional[str] = None) -> Corpus:
    """newstestYEAR for ``pair`` ("de-en"), from files or ``text_dir``, else through sacreBLEU.

    ``source``/``reference`` name the files directly (any test set, e.g.
    Multi30k's); ``text_dir`` holds ``newstestYEAR.SRC`` and ``newstestYEAR.TGT``
    (as ``shared/data/wmt/de-en``); with neither, sacreBLEU downloads WMT's copy.
    """
    src, tgt = pair.split("-")
    name = "newstest{}".format(year)
    if (source is None) != (reference is None):
        raise CorpusError("give both --source and --reference, or neither")
    if source is not None:
        testset = Corpus(os.path.basename(source).rsplit(".", 1)[0], read_lines(source), read_lines(reference),
                          os.path.abspath(source))
    elif text_dir is not None:
        path = os.path.join(text_dir, "{}.{}".format(name, src))
        testset = Corpus(name, read_lines(path), read_lines(os.path.join(text_dir, "{}.{}".format(name, tgt))),
                          os.path.abspath(path))
    else:
        testset = Corpus(name, *_sacrebleu_lines(pair, year), "sacrebleu:wmt{}".format(str(year)[-2:]))
    if len(testset.source) != len(testset.reference):
        raise CorpusError("{}: {} source lines but {} reference lines".format(
            testset.name, len(testset.source), len(testset.reference)))
    if not testset.source:
        raise CorpusError("{}: no sentences".format(testset.name))
    return testset


def _sacrebleu_lines(pair: str, year: str):
    """Source and reference through ``sacrebleu --echo`` (downloads on first use)."""
    src, tgt = pair.split("-")
    test = "wmt{}".format(str(year)[-2:])
    lines = []
    for side in ("src", "ref"):
        proc = subprocess.run([sys.executable, "-m", "sacrebleu", "-t", test, "-l", pair, "--echo", side],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            reason = (proc.stderr.strip().splitlines() or ["exit {}".format(proc.returncode)])[-1]
            raise CorpusError(
                "cannot get newstest{} {} through sacreBLEU ({}). Offline: --text-dir DIR holding "
                "newstest{}.{} and newstest{}.{}, one sentence a line".format(
                    year, pair, reason.strip()[:200], year, src, year, tgt))
        lines.append(proc.stdout.rstrip("\n").split("\n"))
    return lines
