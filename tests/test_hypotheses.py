"""Hypothesis scores normalized as fairseq normalizes them on each device: bitwise."""

import numpy as np
import torch

from fairseq_stream import hypotheses as hyp


def test_scores_are_divided_as_fairseq_divides_on_the_cpu_and_on_cuda():
    g = torch.Generator().manual_seed(0)
    finals = (-torch.rand(500, generator=g) * 30).tolist()
    lens = torch.randint(1, 60, (500,), generator=g).tolist()
    cumulative = torch.tensor(finals, dtype=torch.float32)
    # fairseq: eos_scores /= (step + 1) ** len_penalty, a float32 tensor divided by a Python float: on the CPU a
    # division by the scalar rounded to float32; torch's CUDA kernel multiplies by that scalar's reciprocal.
    cpu = [float(c / (n ** 1.2)) for c, n in zip(cumulative, lens)]
    cuda = [float(c * (np.float32(1.0) / np.float32(n ** 1.2))) for c, n in zip(cumulative, lens)]
    assert hyp.normalized(finals, lens, torch.float32, True, 1.2) == cpu
    assert hyp.normalized(finals, lens, torch.float32, True, 1.2, reciprocal=True) == cuda
    assert cpu != cuda  # the two roundings differ on some of them: which one matters
    assert hyp.normalized(finals, lens, torch.float32, False, 1.2, reciprocal=True) == cumulative.tolist()


def test_scores_become_0d_tensors_of_the_score_type_on_the_given_device():
    values = [-0.25, -1.5, -3.0625]
    scores = hyp.score_tensors(values, torch.float64, torch.device("cpu"))
    assert [s.dim() for s in scores] == [0, 0, 0] and {s.dtype for s in scores} == {torch.float64}
    assert [float(s) for s in scores] == values
    assert hyp.score_tensors([], torch.float32, "cpu") == []
    assert hyp.empty_hypothesis(2, torch.device("cpu"))["score"].device.type == "cpu"
