"""Decoding with the fused output layer (``--output-layer fused``) against the torch output layer.

The fused layer turns the models' logits into each row's best candidates in
one compiled kernel call (``fairseq_stream.ops.topk_log_softmax``); the torch
layer is today's arithmetic (the ensemble's log-probabilities, the rules on
the full matrix, ``topk``). Exactness is tested in float64, where the kernel's
own exp/log and summation order leave differences of about 1e-13: every
search's n-best lists must then be identical in tokens and equal in scores to
1e-9, under every scheduler, with every rule of the output layer in play.
In float32 the printed hypotheses of the toy sets must be identical; the
Multi30k model's whole test set is checked by ``benchmarks/bench_step.py``.
"""

import pytest
import torch

from conftest import decode, decoder_options, differences, generate_in_process, hypotheses, sorted_batches
from fairseq_stream.decoder import BeamDecoder
from fairseq_stream.errors import FairseqStreamError
from fairseq_stream.ops import loader, output_layer

needs_cpu_kernel = pytest.mark.skipif(
    output_layer.auto_backend("cpu") != "cpu",
    reason="the CPU output-layer kernel is not built (fairseq_stream._ops_cpu: {})".format(
        output_layer.missing_reason("cpu")))

SEARCHES = ("greedy", "fixed", "fixed-stay", "var-batch", "var-fairseq")
SCHEDULERS = {
    "batch": None,
    "stream": dict(pool_size=8, eps=1 / 6, order="shortest"),
    "fifo": dict(pool_size=8, eps=1 / 6, order="fifo"),
}
# Every rule of the output layer: --unkpen, --temperature, EOS banned below
# --min-len and forced at each sentence's maximum length (short outputs, so
# most sentences reach it). The toy models never favour unk: a negative
# penalty (a bonus) puts it into about a quarter of the outputs.
RULES = dict(unk_penalty=-6.0, temperature=0.8, min_len=3, max_len_a=0.5, max_len_b=2)


@pytest.fixture(autouse=True)
def log_choices_again(monkeypatch):
    """The runner and output-layer choices are logged once per process; each test sees its own."""
    from fairseq_stream import runners

    monkeypatch.setattr(runners, "_said", set())


def both(models, task, runner, opts):
    """(torch decoder, fused decoder) with the same options."""
    ref = BeamDecoder(models, task.target_dictionary, runner=runner, output_layer="torch", **opts)
    fused = BeamDecoder(models, task.target_dictionary, runner=runner, output_layer="fused", **opts)
    assert not ref.fused and fused.fused
    return ref, fused


@needs_cpu_kernel
@pytest.mark.parametrize("rules", [False, True], ids=["plain", "rules"])
@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
@pytest.mark.parametrize("search", SEARCHES)
@pytest.mark.parametrize("name", ["transformer", "ensemble"])
def test_fused_nbest_equals_torch_float64(exact, name, search, scheduler, rules):
    if rules and scheduler == "fifo":
        pytest.skip("the rules run under batch and stream (FIFO's mixed calls are the plain cases')")
    models, task = exact(name)
    opts = dict(decoder_options(search), **(RULES if rules else {}))
    ref, fused = both(models, task, "lean", opts)
    batches = sorted_batches(task, 8, 40)
    expected = decode(ref, models, batches, None)
    ours = decode(fused, models, batches, SCHEDULERS[scheduler])
    assert differences(expected, ours) == []


@needs_cpu_kernel
@pytest.mark.parametrize("search", ["greedy", "var-batch"])
def test_fused_on_the_fairseq_runner_float64(exact, float64_fairseq, search):
    """The fairseq runner's logits (an LSTM, which the lean runner does not take) through the fused layer."""
    models, task = exact("lstm")
    opts = dict(decoder_options(search), **RULES)
    ref, fused = both(models, task, "fairseq", opts)
    assert fused.runner.name == "fairseq"
    batches = sorted_batches(task, 8, 40)
    assert differences(decode(ref, models, batches, None), decode(fused, models, batches, None)) == []


@needs_cpu_kernel
@pytest.mark.parametrize("search,k", [("greedy", 1), ("fixed", 5), ("var-batch", 50)])
def test_fused_float32_prints_the_same_hypotheses(loaded, search, k):
    """float32, as users run it: every toy test and valid sentence's best hypothesis, ensemble, streamed."""
    models, task = loaded("ensemble")
    opts = dict(decoder_options(search), beam_size=k)
    ref, fused = both(models, task, "lean", opts)
    for subset in ("test", "valid"):
        batches = sorted_batches(task, 16, 1000, subset)
        expected = decode(ref, models, batches, None)
        ours = decode(fused, models, batches, SCHEDULERS["stream"])
        assert {s: h[0]["tokens"].tolist() for s, h in expected.items()} == \
            {s: h[0]["tokens"].tolist() for s, h in ours.items()}
        worst = max(abs(float(expected[s][0]["score"]) - float(ours[s][0]["score"])) for s in expected)
        assert worst < 1e-5


@needs_cpu_kernel
def test_command_line_fused_prints_what_torch_prints(toy, capsys, caplog):
    base = [toy.data_bin, "--path", toy.transformer, "--user-dir", "fairseq_stream", "--search", "var-stream",
            "--beam", "5", "--gen-subset", "valid", "--batch-size", "32", "--cpu"]
    printed = {}
    for layer in ("torch", "fused"):
        with caplog.at_level("INFO"):
            generate_in_process(base + ["--output-layer", layer])
        printed[layer] = hypotheses(capsys.readouterr().out)
    assert len(printed["fused"]) == 200
    assert {s: t for s, (_, t) in printed["torch"].items()} == {s: t for s, (_, t) in printed["fused"].items()}
    assert any("using the fused output layer (cpu kernel)" in r.getMessage() for r in caplog.records)


@needs_cpu_kernel
def test_auto_choices(loaded, caplog):
    """auto: fused for our searches, torch where fairseq's bits are promised or a rule needs every word."""
    models, task = loaded("transformer")
    d = task.target_dictionary
    assert BeamDecoder(models, d, beam_size=5, finalize="stay", output_layer="auto").output_backend == "cpu"
    assert BeamDecoder(models, d, beam_size=1, output_layer="auto", keep_reference=False).output_backend == "cpu"
    # --search fixed --finalize fairseq: bitwise fairseq's, unless fused is asked for.
    assert BeamDecoder(models, d, beam_size=5, output_layer="auto").output_backend == "torch"
    assert BeamDecoder(models, d, beam_size=5, output_layer="fused").output_backend == "cpu"
    assert BeamDecoder(models, d, beam_size=5, runner="auto", output_layer="auto").output_backend == "torch"
    # ... and unless another runner is asked for: without fairseq's runner the promise is gone.
    assert BeamDecoder(models, d, beam_size=5, runner="lean", output_layer="auto").output_backend == "cpu"
    with caplog.at_level("INFO"):
        dec = BeamDecoder(models, d, beam_size=5, finalize="stay", output_layer="fused", no_repeat_ngram_size=2)
    assert dec.output_backend == "torch"
    assert any("--no-repeat-ngram-size needs every word's log-probability; using the torch output layer"
               in r.getMessage() for r in caplog.records)


def test_greedy_command_line_takes_the_lean_runner_and_fused_layer(toy, capsys, caplog):
    """Greedy promises greedy's tokens, not fairseq's bits: auto takes the fast parts."""
    with caplog.at_level("INFO"):
        generate_in_process([toy.data_bin, "--path", toy.transformer, "--user-dir", "fairseq_stream",
                             "--search", "greedy", "--gen-subset", "test", "--batch-size", "8", "--cpu"])
    assert len(hypotheses(capsys.readouterr().out)) == 37
    messages = [r.getMessage() for r in caplog.records]
    assert any("using the lean runner" in m for m in messages)
    if output_layer.auto_backend("cpu") == "cpu":
        assert any("using the fused output layer" in m for m in messages)


def test_fused_without_a_kernel_is_a_one_line_error_and_auto_falls_back(loaded, monkeypatch, caplog):
    """A machine where the extension did not build: fused refuses, auto says so and uses torch."""
    models, task = loaded("transformer")
    monkeypatch.setitem(loader._EXTENSIONS, "cpu", None)
    monkeypatch.setitem(loader._MISSING, "cpu", "No module named 'fairseq_stream._ops_cpu'")
    with pytest.raises(FairseqStreamError, match="--output-layer fused: no compiled output layer for cpu"):
        BeamDecoder(models, task.target_dictionary, beam_size=5, finalize="stay", output_layer="fused")
    with caplog.at_level("INFO"):
        dec = BeamDecoder(models, task.target_dictionary, beam_size=5, finalize="stay", output_layer="auto")
    assert dec.output_backend == "torch"
    assert any("no compiled output layer for cpu; using the torch output layer" in r.getMessage()
               for r in caplog.records)


def test_unknown_output_layer_is_refused(loaded):
    models, task = loaded("transformer")
    with pytest.raises(FairseqStreamError, match="--output-layer must be one of auto, fused, torch"):
        BeamDecoder(models, task.target_dictionary, output_layer="fast")
