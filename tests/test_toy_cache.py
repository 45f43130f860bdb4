"""scripts/toy_cache.py: one trained toy per machine, where XDG says, shared by the quickstart and the suite."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, run_tool, toy_cache

SCRIPT = REPO / "scripts" / "toy_cache.py"


def test_the_cache_follows_fairseq_stream_cache_then_xdg_cache_home_then_home():
    home = Path.home() / ".cache" / "fairseq-stream"
    assert toy_cache.cache_base({}) == home
    assert toy_cache.cache_base({"XDG_CACHE_HOME": "/x/cache"}) == Path("/x/cache/fairseq-stream")
    assert toy_cache.cache_base({"XDG_CACHE_HOME": "relative/cache"}) == home  # invalid per the spec: ignored
    assert toy_cache.cache_base({"XDG_CACHE_HOME": "/x/cache", "FAIRSEQ_STREAM_CACHE": "/y"}) == Path("/y")
    assert toy_cache.cache_dir({"XDG_CACHE_HOME": "/x"}).name == "toy-" + toy_cache.toy_key()


def test_the_suite_uses_the_cache_the_quickstart_uses(toy):
    assert toy.root == toy_cache.cache_dir()
    assert (toy.root / "DONE").exists()


def fake_cache(toy, base):
    """``base`` as a cache holding the suite's trained toy (symlinked parts: nothing is trained)."""
    target = base / toy_cache.cache_dir({"FAIRSEQ_STREAM_CACHE": str(base)}).name
    target.mkdir(parents=True)
    for part in toy_cache.PARTS:
        (target / part).symlink_to(toy.root / part)
    (target / "DONE").write_text("")
    return target


def test_a_trained_copy_under_xdg_cache_home_is_reused_not_retrained(toy, tmp_path, monkeypatch):
    """The suite honours $XDG_CACHE_HOME, and finds there what the quickstart (or a test run) trained."""
    target = fake_cache(toy, tmp_path / "xdg" / "fairseq-stream")
    monkeypatch.delenv("FAIRSEQ_STREAM_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))

    def no_training(*args, **kwargs):
        raise AssertionError("trained again")

    monkeypatch.setattr(toy_cache, "train", no_training)
    assert toy_cache.ensure() == target


def test_training_removes_stale_scratch_folders_and_a_failure_leaves_none(tmp_path, monkeypatch):
    monkeypatch.setenv("FAIRSEQ_STREAM_CACHE", str(tmp_path))
    target = toy_cache.cache_dir()
    stale = target.with_name(target.name + ".tmp999999")
    stale.mkdir()

    def failing(work, log=None):
        work.mkdir()
        raise subprocess.CalledProcessError(1, "train_toy.sh")

    monkeypatch.setattr(toy_cache, "train", failing)
    with pytest.raises(subprocess.CalledProcessError):
        toy_cache.ensure()
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name + ".lock"]


def test_the_quickstarts_copy_comes_from_the_cache(toy, tmp_path):
    """What scripts/quickstart.sh runs when toy/ has no DONE: a copy of the cached toy, stamped with its hash."""
    cache = tmp_path / "cache"
    target = fake_cache(toy, cache)
    dest = tmp_path / "toy"
    (dest / "transformer").mkdir(parents=True)
    (dest / "transformer" / "leftover.pt").write_text("from an interrupted copy")
    proc = run_tool([sys.executable, SCRIPT, "--copy-to", dest, "--log", tmp_path / "train.log"],
                    env={"FAIRSEQ_STREAM_CACHE": str(cache)})
    assert proc.stdout.strip() == str(target) and "training" not in proc.stderr
    assert not (tmp_path / "train.log").exists()
    assert (dest / "DONE").read_text().strip() == toy_cache.toy_key()
    for rel in ("transformer/checkpoint_best.pt", "lstm/checkpoint_best.pt", "data-bin/dict.src.txt",
                "raw/valid.src"):
        assert (dest / rel).read_bytes() == (toy.root / rel).read_bytes()
    assert sorted(os.listdir(dest / "transformer")) == sorted(os.listdir(toy.root / "transformer"))
    assert 'toy_cache.py --copy-to "$TOY"' in (REPO / "scripts" / "quickstart.sh").read_text()
