"""fairseq checkpoints load safely under torch 2.13's weights_only unpickler."""

import datetime

import pytest
import torch

from conftest import full_state, hypotheses, run_tool, unsafe_copy
from fairseq_stream.checkpoint import load_checkpoint_to_cpu, load_state
from fairseq_stream.errors import UnsafeCheckpointError


def legacy_copy(src, dst):
    """An argparse-style checkpoint, as fairseq < 0.10 wrote them: ``args``, no ``cfg``.

    The LSTM is a legacy (add_args) architecture, so its cfg-style checkpoint
    already holds the complete flat argument Namespace in ``cfg.model``.
    """
    state = full_state(src)
    args = state["cfg"]["model"]
    assert args.__class__.__name__ == "Namespace" and args.arch == "lstm"
    legacy = {k: v for k, v in state.items() if k != "cfg"}
    legacy["args"] = args
    torch.save(legacy, dst)
    return dst


def generate(toy, path, *extra):
    return run_tool(
        ["fairseq-generate", toy.data_bin, "--path", path, "--gen-subset", "test", "--batch-size", "8",
         "--beam", "5", "--cpu", "--user-dir", "fairseq_stream"] + list(extra),
        check=False,
    )


@pytest.mark.parametrize("which", ["transformer", "lstm"])
def test_cfg_style_checkpoints_load_without_trust(toy, which):
    state = load_checkpoint_to_cpu(str(getattr(toy, which)))
    assert state["cfg"].model._name == which
    assert "model" in state


def test_argparse_style_checkpoint_loads_and_decodes_like_the_cfg_style_one(toy, tmp_path):
    legacy = legacy_copy(toy.lstm, tmp_path / "legacy.pt")
    assert "cfg" not in full_state(legacy)
    state = load_checkpoint_to_cpu(str(legacy))
    assert state["cfg"].model.arch == "lstm"  # fairseq's upgrade made a cfg from args
    new = generate(toy, toy.lstm, "--search", "fixed")
    old = generate(toy, legacy, "--search", "fixed")
    assert old.returncode == 0, old.stderr[-2000:]
    assert hypotheses(old.stdout) == hypotheses(new.stdout)


def test_ensemble_of_two_checkpoints_loads(toy):
    proc = generate(toy, "{}:{}".format(toy.transformer, toy.transformer2), "--search", "fixed")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(hypotheses(proc.stdout)) == 37


def test_unsafe_global_is_refused_with_its_name_and_the_opt_in(toy, tmp_path):
    path = unsafe_copy(toy, tmp_path / "unsafe.pt")
    with pytest.raises(UnsafeCheckpointError) as err:
        load_state(str(path))
    assert "datetime.date" in str(err.value) and "--trust-checkpoint" in str(err.value)

    proc = generate(toy, path, "--search", "beam")
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("fairseq-stream: error: refusing to load checkpoint")
    assert "'datetime.date'" in last and "--trust-checkpoint" in last


def test_trust_flag_loads_exactly_the_named_files(toy, tmp_path):
    path = unsafe_copy(toy, tmp_path / "unsafe.pt")
    assert load_state(str(path), trust=True)["extra_state"]["note"] == datetime.date(2020, 1, 1)
    proc = generate(toy, path, "--search", "beam", "--trust-checkpoint")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(hypotheses(proc.stdout)) == 37
    # Trust is not a process-wide switch: another untrusted file is still refused.
    with pytest.raises(UnsafeCheckpointError):
        load_state(str(unsafe_copy(toy, tmp_path / "other" / "unsafe.pt")))
