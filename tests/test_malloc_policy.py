"""Our runners keep freed memory in the process (glibc mallopt): applied once where they are built, never for
fairseq's runner, and left alone under FAIRSEQ_STREAM_SYSTEM_MALLOC=1. Each case runs in a fresh process: the
policy is process-wide."""

import platform
import sys

import pytest

from conftest import run_tool

glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                           reason="the policy applies to glibc only")

BUILD = """
import sys
from fairseq import checkpoint_utils
from fairseq_stream import malloc_policy
from fairseq_stream.runners import build_runner
models, _, _ = checkpoint_utils.load_model_ensemble_and_task([sys.argv[1]], arg_overrides={{"data": sys.argv[2]}})
build_runner("fairseq", models)
print("after fairseq", malloc_policy._applied)
build_runner("{kind}", models)
print("after {kind}", malloc_policy._applied)
"""


@glibc
@pytest.mark.parametrize("kind, model", [("lean", "transformer"), ("rnn", "lstm")])
def test_our_runners_keep_freed_memory_and_fairseqs_does_not(toy, kind, model):
    out = run_tool([sys.executable, "-c", BUILD.format(kind=kind), getattr(toy, model), toy.data_bin]).stdout
    assert "after fairseq None" in out and "after {} True".format(kind) in out


@glibc
@pytest.mark.parametrize("value", ["1", "yes"])
def test_the_environment_leaves_malloc_alone(toy, value):
    out = run_tool([sys.executable, "-c", BUILD.format(kind="lean"), toy.transformer, toy.data_bin],
                   env={"FAIRSEQ_STREAM_SYSTEM_MALLOC": value}).stdout
    assert "after lean False" in out


@glibc
def test_it_asks_glibc_once_and_says_so_once():
    code = ("import logging; logging.basicConfig(level=logging.INFO)\n"
            "from fairseq_stream import malloc_policy\n"
            "print(malloc_policy.keep_freed_memory(), malloc_policy.keep_freed_memory())")
    proc = run_tool([sys.executable, "-c", code])
    assert proc.stdout.strip() == "True True"
    assert proc.stderr.count("keeping freed memory") == 1
