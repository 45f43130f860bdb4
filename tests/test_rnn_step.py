"""The fused ``--rnn-int16`` step (``fairseq_stream.ops.rnn_step``) against the rnn runner's torch int16 step.

The fused step computes the same step with the same int16 products, but its
cells, attention and activations in compiled loops with approximate exp and
tanh: results differ from the torch step by float rounding only. Checked
here step by step on real models (the toy LSTM, an ensemble, a random
two-layer LSTM with residuals and a tied output layer), with shared parents
and with two groups of rows in one call, and end to end on every toy
sentence; the activations against float64 references.
"""

import pytest
import torch

from conftest import decode, decoder_options, sorted_batches
from fairseq_stream.decoder import BeamDecoder
from fairseq_stream.ops import rnn_step
from fairseq_stream.runners.rnn import RnnOptions, RnnRunner
from test_rnn_runner import SCHEDULERS, agreement, perturbed_copy, toy_sentences, two_layer_lstm

pytestmark = pytest.mark.skipif(not rnn_step.available(),
                                reason="the CPU extension is not built (python setup.py build_ext --inplace)")

# The fused step's logits and states against the torch int16 step's, relative to
# the largest magnitude (logits of order 10 on the toy LSTM): seen 2.7e-5. Float
# rounding alone is ~1e-7, but a rounding difference in a product's input can
# move a value's int16 quantization by one step (1/a_max of its row's peak, about
# 3e-5 here), which the product then carries. The bound leaves 7x.
STEP_BOUND = 2e-4
# Scores where the tokens agree, toy LSTM, 237 sentences: seen 7e-5 (int16
# quantization steps moved, as above); int16 against float32 is 2.3e-4.
SCORE_BOUND = 5e-4


def test_activations_are_within_their_bounds():
    x = torch.linspace(-87, 88, 200001)
    exact = torch.exp(x.double())
    ulp = torch.pow(2.0, torch.floor(torch.log2(exact)) - 23)
    assert ((rnn_step.exp_approx(x).double() - exact).abs() / ulp).max() <= 1.0
    y = torch.linspace(-30, 30, 200001)
    assert (rnn_step.sigmoid_approx(y).double() - torch.sigmoid(y.double())).abs().max() <= 1e-7
    assert (rnn_step.tanh_approx(y).double() - torch.tanh(y.double())).abs().max() <= 1e-7
    ends = torch.tensor([float("-inf"), float("inf")])
    assert rnn_step.tanh_approx(ends).tolist() == [-1.0, 1.0]
    assert rnn_step.sigmoid_approx(ends).tolist()[1] == 1.0


@pytest.fixture(scope="module")
def models32(loaded):
    """name -> (float32 models, task): the toy LSTM, a two-model ensemble, a random two-layer LSTM."""
    (toy,), task = loaded("lstm")
    return {"lstm": ([toy], task), "ensemble": ([toy, perturbed_copy(toy)], task),
            "two-layer": ([two_layer_lstm(task)], task)}


def close(a, b):
    scale = max(float(b.abs().max()), 1.0)
    return float((a - b).abs().max()) <= STEP_BOUND * scale


def states_close(fused, plain):
    return all(close(getattr(f, n), getattr(p, n))
               for f, p in zip(fused.recurrent, plain.recurrent) for n in ("h", "c", "feed"))


@pytest.mark.parametrize("name", ["lstm", "ensemble", "two-layer"])
@pytest.mark.parametrize("int16_output", [True, False])
def test_each_step_equals_the_torch_int16_step(models32, name, int16_output):
    models, task = models32[name]
    options = dict(int16=True, int16_output=int16_output)
    fused = RnnRunner(models, options=RnnOptions(**options))
    plain = RnnRunner(models, options=RnnOptions(fused_step=False, **options))
    assert all(m.fused is not None for m in fused.rnn) and all(m.fused is None for m in plain.rnn)
    sample = sorted_batches(task, 6, 40)[2]
    S, k = sample["id"].numel(), 3
    with torch.inference_mode():
        sf = fused.start(sample["net_input"], 1, sample["id"])
        sp = plain.start(sample["net_input"], 1, sample["id"])
        tokens = torch.full((S, 1), task.target_dictionary.eos())
        for step in range(5):
            per_model_f, _ = fused.step(sf, tokens, logits=True)  # each model's logits
            per_model_p, _ = plain.step(sp, tokens, logits=True)
            assert all(close(f, p) for f, p in zip(per_model_f, per_model_p)), step
            assert states_close(sf, sp), step
            lp = per_model_p[0]
            # The next rows: k children of each sentence's first row (shared parents), then of every row.
            rows = lp.size(0)
            order = (torch.arange(S) * (rows // S)).repeat_interleave(k) if step == 0 else \
                torch.arange(rows).flip(0)
            words = lp.topk(k, dim=1).indices
            tokens = words[order, torch.arange(order.numel()) % k].unsqueeze(1)
            fused.reorder(sf, order)
            plain.reorder(sp, order)


def test_two_groups_of_rows_in_one_call(models32):
    """step_mixed (FIFO): rows of two states, each attending to its own sentences."""
    models, task = models32["lstm"]
    fused = RnnRunner(models, options=RnnOptions(int16=True))
    plain = RnnRunner(models, options=RnnOptions(int16=True, fused_step=False))
    a, b = sorted_batches(task, 4, 40)[1:3]
    with torch.inference_mode():
        out = []
        for runner in (fused, plain):
            states = [runner.start(s["net_input"], 1, s["id"]) for s in (a, b)]
            rows = sum(s.rows for s in states)
            last = torch.full((rows,), task.target_dictionary.eos())
            (logits,), _ = runner.step_mixed(states, last, [1, 1], logits=True)
            out.append((logits, states))
    assert close(out[0][0], out[1][0])
    assert all(states_close(f, p) for f, p in zip(out[0][1], out[1][1]))


@pytest.fixture(scope="module")
def toy32(loaded):
    models, task = loaded("lstm")
    return models, task, toy_sentences(task)


def test_decoding_agrees_with_the_torch_int16_step(toy32):
    """Every toy sentence (237), beam 5: the same translations, scores within SCORE_BOUND."""
    models, task, batches = toy32
    runs = [decode(BeamDecoder(models, task.target_dictionary, runner="rnn", keep_reference=False,
                               rnn_options=RnnOptions(int16=True, fused_step=fused), **decoder_options("fixed")),
                   models, batches, None) for fused in (True, False)]
    share, worst, _ = agreement(runs[1], runs[0])
    assert share >= 0.99 and worst <= SCORE_BOUND


@pytest.mark.parametrize("scheduler", ["stream", "fifo"])
def test_schedulers_give_batch_results_exactly(toy32, scheduler):
    """Each row is computed on its own: batch, stream and fifo give identical n-best lists."""
    models, task, _ = toy32
    batches = sorted_batches(task, 8, 40)
    make = lambda: BeamDecoder(models, task.target_dictionary, runner="rnn", keep_reference=False,
                               rnn_options=RnnOptions(int16=True), **decoder_options("var-batch"))
    ref = decode(make(), models, batches, None)
    ours = decode(make(), models, batches, SCHEDULERS[scheduler])
    assert sorted(ours) == sorted(ref)
    for sid in ref:
        assert [h["tokens"].tolist() for h in ours[sid]] == [h["tokens"].tolist() for h in ref[sid]]
        assert [float(h["score"]) for h in ours[sid]] == [float(h["score"]) for h in ref[sid]]


def test_the_torch_step_runs_where_the_fused_one_cannot(models32, caplog):
    models, _ = models32["lstm"]
    assert RnnRunner(models, options=RnnOptions(int16=True, attention_table=False)).rnn[0].fused is None
    assert RnnRunner(models, options=RnnOptions()).rnn[0].fused is None  # float32: the exact step
    assert "fused step" in RnnOptions(int16=True).describe()
    assert "fused step" not in RnnOptions(int16=True, fused_step=False).describe()
