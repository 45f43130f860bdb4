"""Test text into a data-bin for fairseq-generate: the model's tokenizer, its BPE, its dictionaries.

The encoders are fairseq's own (``--tokenizer moses``, ``--bpe fastbpe`` /
``sentencepiece``), the very objects fairseq-generate uses to turn its
output back into text (its D- lines), so encoding and decoding agree.
Binarizing is fairseq-preprocess with the model's dictionaries. Each prepared
input is cached under a hash of everything that goes into it.
"""

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import List, Optional

from fairseq_stream.newstest import NewstestError
from fairseq_stream.newstest.testset import Corpus

TOKENIZERS = ("moses", "none")
# A preparation in progress: NAME.tmp<PID>@<host> (older versions wrote NAME.tmp<PID>).
TMP_SUFFIX = re.compile(r"\.tmp(\d+)(?:@(.+))?$")
BPES = ("fastbpe", "sentencepiece", "none")


class PrepareError(NewstestError):
    """Preparing the input failed; the message is one line."""


@dataclass(frozen=True)
class Encoding:
    """How the model's text is tokenized and split into subwords."""

    tokenizer: str = "moses"
    bpe: str = "fastbpe"
    bpe_codes: Optional[str] = None
    sentencepiece_model: Optional[str] = None

    def check(self):
        """One-line errors for a missing codes or sentencepiece file."""
        if self.tokenizer not in TOKENIZERS:
            raise PrepareError("--tokenizer {}: choose from {}".format(self.tokenizer, ", ".join(TOKENIZERS)))
        if self.bpe not in BPES:
            raise PrepareError("--bpe {}: choose from {}".format(self.bpe, ", ".join(BPES)))
        needed = {"fastbpe": ("--bpe-codes", self.bpe_codes),
                  "sentencepiece": ("--sentencepiece-model", self.sentencepiece_model)}.get(self.bpe)
        if needed and (needed[1] is None or not os.path.isfile(needed[1])):
            raise PrepareError("--bpe {} needs {} FILE ({})".format(
                self.bpe, needed[0], "not found: " + needed[1] if needed[1] else "not given"))

    def generate_args(self) -> List[str]:
        """fairseq-generate options that undo this encoding in its D- lines."""
        args = []
        if self.tokenizer != "none":
            args += ["--tokenizer", self.tokenizer]
        if self.bpe == "fastbpe":
            args += ["--bpe", "fastbpe", "--bpe-codes", self.bpe_codes]
        elif self.bpe == "sentencepiece":
            args += ["--bpe", "sentencepiece", "--sentencepiece-model", self.sentencepiece_model]
        return args

    def encoder(self, src: str, tgt: str):
        """A function raw sentence -> model input, built from fairseq's encoders."""
        from fairseq.data import encoders

        tokenizer = bpe = None
        if self.tokenizer != "none":
            tokenizer = encoders.build_tokenizer(argparse.Namespace(
                tokenizer=self.tokenizer, source_lang=src, target_lang=tgt))
        if self.bpe != "none":
            with _quiet_stdout():  # fastBPE prints "Loading codes from ..." on the process's stdout
                bpe = encoders.build_bpe(argparse.Namespace(
                    bpe=self.bpe, bpe_codes=self.bpe_codes, sentencepiece_model=self.sentencepiece_model))

        def encode(line: str) -> str:
            if tokenizer is not None:
                line = tokenizer.encode(line)
            if bpe is not None:
                line = bpe.encode(line)
            return line

        return encode


@contextlib.contextmanager
def _quiet_stdout():
    """File descriptor 1 to /dev/null for a while (C++ code's prints), unless FAIRSEQ_STREAM_VERBOSE is set."""
    if os.environ.get("FAIRSEQ_STREAM_VERBOSE", "") not in ("", "0"):
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def _file_digest(path: Optional[str]) -> Optional[str]:
    if path is None:
        return None
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def cache_key(testset: Corpus, pair: str, encoding: Encoding, srcdict: str, tgtdict: str) -> str:
    """A hash of every input of :func:`prepare`: text, encoding files and dictionaries by content."""
    digest = hashlib.sha256()
    digest.update(json.dumps({
        "pair": pair, "source": testset.source, "reference": testset.reference,
        "encoding": asdict(encoding), "codes": _file_digest(encoding.bpe_codes),
        "spm": _file_digest(encoding.sentencepiece_model),
        "srcdict": _file_digest(srcdict), "tgtdict": _file_digest(tgtdict),
    }, sort_keys=True).encode("utf-8"))
    return digest.hexdigest()[:16]


def prepare(testset: Corpus, pair: str, encoding: Encoding, srcdict: str, tgtdict: str, work_dir: str) -> str:
    """Encode and binarize ``testset`` as the ``test`` split; return the data-bin directory (cached)."""
    src, tgt = pair.split("-")
    for flag, path in (("--srcdict", srcdict), ("--tgtdict", tgtdict)):
        if not os.path.isfile(path):
            raise PrepareError("{} {}: no such file".format(flag, path))
    encoding.check()
    target = os.path.join(work_dir, "prepared", "{}.{}.{}".format(
        testset.name, pair, cache_key(testset, pair, encoding, srcdict, tgtdict)))
    data_bin = os.path.join(target, "data-bin")
    remove_stale_work(os.path.dirname(target))
    if os.path.exists(os.path.join(target, "DONE")):
        return data_bin
    work = "{}.tmp{}@{}".format(target, os.getpid(), socket.gethostname())
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    try:
        _prepare_in(work, testset, src, tgt, encoding, srcdict, tgtdict)
    except BaseException:  # a failure or an interruption (Ctrl-C; SIGTERM, see newstest.exit_on_signals)
        shutil.rmtree(work, ignore_errors=True)
        raise
    shutil.rmtree(target, ignore_errors=True)
    os.rename(work, target)
    return data_bin


def _prepare_in(work, testset, src, tgt, encoding, srcdict, tgtdict):
    """Encode and binarize into the scratch folder ``work``, ending with its DONE stamp."""
    encode = encoding.encoder(src, tgt)
    for lang, lines in ((src, testset.source), (tgt, testset.reference)):
        with open(os.path.join(work, "test." + lang), "w", encoding="utf-8") as f:
            for line in lines:
                f.write(encode(line) + "\n")
    proc = subprocess.run(
        [sys.executable, "-m", "fairseq_cli.preprocess", "--source-lang", src, "--target-lang", tgt,
         "--srcdict", srcdict, "--tgtdict", tgtdict, "--testpref", os.path.join(work, "test"),
         "--destdir", os.path.join(work, "data-bin"), "--workers", "1"],
        capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["exit {}".format(proc.returncode)])[-1]
        raise PrepareError("fairseq-preprocess failed: {}".format(last))
    with open(os.path.join(work, "DONE"), "w") as f:
        f.write("\n")


def remove_stale_work(prepared_dir):
    """Remove the scratch folders of preparations whose process is gone (killed with SIGKILL, a crash).

    Only this host's: a folder named for another host may belong to a live
    process there (a shared file system). Folders without a host are from
    older versions, which wrote them on this host as far as anyone can tell.
    """
    try:
        names = os.listdir(prepared_dir)
    except OSError:
        return
    host = socket.gethostname()
    for name in names:
        match = TMP_SUFFIX.search(name)
        if match and match.group(2) in (None, host) and not _alive(int(match.group(1))):
            shutil.rmtree(os.path.join(prepared_dir, name), ignore_errors=True)


def _alive(pid):
    """Whether a process ``pid`` exists on this host (one of another user counts)."""
    if pid == os.getpid():
        return False  # this process starts its own preparations afresh
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
