"""Decoding under ``torch.inference_mode``: what leaves it is ordinary tensors, and the mode stays inside.

fairseq-generate changes hypotheses in place (``positional_scores.div_`` for
its P- lines), which an inference tensor refuses outside the mode; the API's
caller runs its own code between two translations, where the mode must not
hold. Real decoding on the toy checkpoints.
"""

import pytest
import torch

from conftest import generate_in_process, sorted_batches
from fairseq_stream.decoder import BeamDecoder


def assert_ordinary(hypotheses):
    for hypothesis in hypotheses:
        for key, value in hypothesis.items():
            if isinstance(value, torch.Tensor):
                assert not value.is_inference(), key
        hypothesis["positional_scores"].div_(2.0)  # what fairseq-generate does


@pytest.mark.parametrize("model,runner", [("transformer", "lean"), ("lstm", "rnn"), ("transformer", "fairseq")])
def test_generate_hands_out_ordinary_tensors(loaded, model, runner):
    models, task = loaded(model)
    decoder = BeamDecoder(models, task.target_dictionary, beam_size=5, runner=runner, finalize="stay")
    for sample in sorted_batches(task, 8, 16):
        out = decoder.generate(models, sample)
        assert len(out) == sample["id"].numel()
        for hypotheses in out:
            assert_ordinary(hypotheses)
    assert not torch.is_inference_mode_enabled()


def test_fairseq_generate_prints_positional_scores_under_var_stream(toy, capsys):
    generate_in_process([toy.data_bin, "--path", toy.transformer, "--user-dir", "fairseq_stream", "--gen-subset",
                         "test", "--batch-size", "8", "--cpu", "--search", "var-stream", "--beam", "5"])
    lines = capsys.readouterr().out.splitlines()
    positional = [line for line in lines if line.startswith("P-")]
    assert len(positional) == len([line for line in lines if line.startswith("H-")]) == 37


def test_the_api_leaves_the_mode_between_translations(toy):
    from fairseq_stream.api import Translator

    translator = Translator([str(toy.transformer)], data=str(toy.data_bin), search="var-stream", beam=5, pool=4,
                            cpu=True, batch_size=4)
    lines = toy.raw.joinpath("valid.src").read_text().splitlines()[:10]
    seen = 0
    for translation in translator.translate(lines):
        assert not torch.is_inference_mode_enabled()
        assert_ordinary(translation.hypotheses)
        seen += 1
    assert seen == 10
