#!/usr/bin/env python3
"""The toy checkpoints, trained once per machine and shared by the quickstart and the test suite.

    python scripts/toy_cache.py [--copy-to DIR] [--log FILE]

``scripts/train_toy.sh`` is deterministic on a given machine, so one trained
copy serves everyone: it lives in ``CACHE/toy-<hash>``, where the hash is that
of the training scripts (a change to them trains a new copy) and CACHE is

* ``$FAIRSEQ_STREAM_CACHE`` where set, else
* ``$XDG_CACHE_HOME/fairseq-stream`` where XDG_CACHE_HOME is set (and absolute,
  as the XDG Base Directory specification requires), else
* ``~/.cache/fairseq-stream``.

The first user trains it under a file lock (the test suite's workers and a
quickstart running beside them wait for it rather than train twice); later
users find its DONE stamp. ``--copy-to DIR`` copies the checkpoints into DIR
(the quickstart's ``toy/``), with a DONE stamp holding the hash. The cache
folder's path is printed on stdout.
"""

import argparse
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOY_SOURCES = ("scripts/train_toy.sh", "scripts/make_toy_data.py")
# What train_toy.sh writes besides its DONE stamp.
PARTS = ("raw", "data-bin", "transformer", "transformer2", "transformer3", "transformer4", "lstm")
PROG = "toy_cache.py"


def cache_base(environ=os.environ) -> Path:
    """This machine's fairseq-stream cache folder (see the module's docstring)."""
    if environ.get("FAIRSEQ_STREAM_CACHE"):
        return Path(environ["FAIRSEQ_STREAM_CACHE"])
    xdg = environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):  # a relative value is invalid per the specification and ignored
        return Path(xdg) / "fairseq-stream"
    return Path.home() / ".cache" / "fairseq-stream"


def toy_key() -> str:
    """The hash of the training scripts: the same scripts train the same toy on this machine."""
    digest = hashlib.sha1()
    for rel in TOY_SOURCES:
        digest.update((REPO / rel).read_bytes())
    return digest.hexdigest()[:12]


def cache_dir(environ=os.environ) -> Path:
    """Where the toy trained by the current training scripts lives (or will)."""
    return cache_base(environ) / "toy-{}".format(toy_key())


def ensure(log=None, environ=os.environ) -> Path:
    """The cached toy folder, trained first if no finished copy is there; returns its path.

    ``log``: a file for the training's output (default: stdout discarded,
    stderr shown). Raises ``subprocess.CalledProcessError`` if training fails.
    """
    target = cache_dir(environ)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "DONE").exists():
            # Holding the lock, any scratch folder of this key is a killed run's.
            for stale in target.parent.glob(target.name + ".tmp*"):
                shutil.rmtree(stale, ignore_errors=True)
            work = target.with_name(target.name + ".tmp{}".format(os.getpid()))
            note("training the toy checkpoints into {} (two minutes or so)".format(target))
            try:
                train(work, log)
            except BaseException:
                shutil.rmtree(work, ignore_errors=True)
                raise
            shutil.rmtree(target, ignore_errors=True)
            work.rename(target)
    return target


def train(out_dir: Path, log=None):
    """``scripts/train_toy.sh OUT_DIR`` with this interpreter's environment's tools first on PATH."""
    env = dict(os.environ)
    env["PATH"] = "{}{}{}".format(Path(sys.executable).parent, os.pathsep, env.get("PATH", ""))
    cmd = ["bash", str(REPO / "scripts" / "train_toy.sh"), str(out_dir)]
    if log is None:
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        return
    with open(log, "w") as f:
        subprocess.run(cmd, check=True, env=env, stdout=f, stderr=subprocess.STDOUT)


def copy_to(source: Path, dest: Path):
    """Copy the toy at ``source`` into ``dest``; its DONE stamp, written last, holds the hash."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "DONE").unlink(missing_ok=True)
    for part in PARTS:
        shutil.rmtree(dest / part, ignore_errors=True)
        shutil.copytree(source / part, dest / part)
    (dest / "DONE").write_text(toy_key() + "\n")


def note(message):
    print("fairseq-stream: {}".format(message), file=sys.stderr, flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--copy-to", metavar="DIR", help="copy the checkpoints into DIR (with a DONE stamp)")
    parser.add_argument("--log", metavar="FILE", help="the training's output, if it trains (default: discarded)")
    args = parser.parse_args(argv)
    try:
        source = ensure(args.log)
    except subprocess.CalledProcessError as e:
        if args.log:
            with open(args.log, errors="replace") as f:
                sys.stderr.write("".join(f.readlines()[-30:]))
        sys.exit("{}: training the toy checkpoints failed (exit {}){}".format(
            PROG, e.returncode, "; log: " + args.log if args.log else ""))
    if args.copy_to:
        copy_to(source, Path(args.copy_to))
        note("toy checkpoints copied from {} into {}".format(source, args.copy_to))
    print(source)


if __name__ == "__main__":
    main()
