"""Stacked ensemble members (runners/stacked.py) against the member-by-member lean runner, on real decoding.

Exactness in float64, end to end, on the toy checkpoints: a 2-member and a
4-member ensemble (``transformer`` .. ``transformer4``, seeds 1 to 4), every
search under every scheduler, and Jacobi: the n-best lists of the stacked
runner equal those of today's member-by-member runner, tokens identical and
scores within 1e-9; the 4-member ensemble also against fairseq's runner.
In float32 on the CPU and quantized, the stacked runner gives the
member-by-member runner's bits.
"""

import pytest
import torch

from conftest import decode, decoder_options, differences, generate_in_process, sorted_batches
from fairseq_stream.decoder import BeamDecoder
from fairseq_stream.jacobi.decoder import JacobiDecoder
from fairseq_stream.runners import build_runner
from fairseq_stream.runners.lean import LeanRunner

SEARCHES = ("greedy", "fixed", "fixed-stay", "var-batch", "var-fairseq")
SCHEDULERS = {
    "batch": None,
    "stream": dict(pool_size=8, eps=1 / 6, order="shortest"),
    "fifo": dict(pool_size=8, eps=1 / 6, order="fifo"),
    # --generator topup: cohorts of different lengths join (one call over segments at their own lengths).
    "topup": dict(pool_size=8, eps=1 / 2, order="fifo"),
}
ENSEMBLES = ("ensemble", "ensemble4")


def lean_decoder(models, task, stack: bool, **opts):
    dec = BeamDecoder(models, task.target_dictionary, runner="lean", keep_reference=False, stack_members=stack,
                      **opts)
    assert isinstance(dec.runner, LeanRunner) and (dec.runner.stacked is not None) == stack
    return dec


@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
@pytest.mark.parametrize("search", SEARCHES)
@pytest.mark.parametrize("name", ENSEMBLES)
def test_stacked_nbest_equals_member_by_member_float64(exact, name, search, scheduler):
    models, task = exact(name)
    batches = sorted_batches(task, 8, 40)
    opts = dict(decoder_options(search), output_layer="fused" if search != "fixed" else "torch")
    ref = decode(lean_decoder(models, task, False, **opts), models, batches, SCHEDULERS[scheduler])
    ours = decode(lean_decoder(models, task, True, **opts), models, batches, SCHEDULERS[scheduler])
    assert len(ours) == 37
    assert differences(ref, ours, tolerance=1e-9) == []


@pytest.mark.parametrize("scheduler", ["batch", "fifo", "topup"])
@pytest.mark.parametrize("search", ["fixed-stay", "var-batch"])
def test_stacked_members_on_torch_attention_float64(exact, search, scheduler):
    """CUDA's path on the CPU: the attentions' torch references over the members folded into the heads."""
    models, task = exact("ensemble4")
    batches = sorted_batches(task, 8, 24)
    out = {}
    for stack in (False, True):
        dec = lean_decoder(models, task, stack, **decoder_options(search))
        dec.runner.compiled_attention = False
        out[stack] = decode(dec, models, batches, SCHEDULERS[scheduler])
    assert differences(out[False], out[True], tolerance=1e-9) == []


def test_four_stacked_members_equal_fairseqs_runner_float64(exact, float64_fairseq):
    """The 4-member ensemble stacked against the reference itself (fairseq's EnsembleModel), fixed beams."""
    models, task = exact("ensemble4")
    batches = sorted_batches(task, 8, 40)
    opts = decoder_options("fixed")
    ref = decode(BeamDecoder(models, task.target_dictionary, runner="fairseq", **opts), models, batches, None)
    assert differences(ref, decode(lean_decoder(models, task, True, **opts), models, batches, None)) == []


@pytest.mark.parametrize("variant,block,draft", [("hgj", 3, "ngram"), ("pgj", 5, "pad")])
def test_jacobi_on_stacked_members_gives_greedys_output_float64(exact, variant, block, draft):
    models, task = exact("ensemble4")
    batches = sorted_batches(task, 8, 1000)
    opts = dict(beam_size=1, output_layer="auto")
    expected = decode(lean_decoder(models, task, False, **opts), models, batches, None)
    dec = JacobiDecoder(lean_decoder(models, task, True, **opts), variant, block, draft, call_cost=1000)
    assert differences(expected, decode(dec, models, batches, None), tolerance=1e-9) == []


def test_members_of_other_shapes_run_one_after_another(exact, caplog, monkeypatch):
    """A member of another shape: the member-by-member step, said in one log line."""
    from fairseq_stream import runners
    from test_lean_runner import random_transformer

    monkeypatch.setattr(runners, "_said", set())

    models, task = exact("transformer")
    other = random_transformer(task, "transformer", encoder_embed_dim=64, decoder_embed_dim=64,
                               encoder_ffn_embed_dim=256, decoder_ffn_embed_dim=256, encoder_layers=2,
                               decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4).double()
    with caplog.at_level("INFO"):
        runner = build_runner("lean", [models[0], other])
    assert runner.stacked is None and runner.unstacked_reason == "model 2 has another shape than model 1"
    assert any("lean runner (2 models, one after another: model 2 has another shape than model 1)"
               in r.getMessage() for r in caplog.records)
    stacked = build_runner("lean", exact("ensemble")[0], stack_members=True)
    assert stacked.stacked is not None and stacked.stacked.heads == 2 * 4


@pytest.mark.parametrize("quantize", ["none", "int8", "int16"])
def test_stacked_members_on_the_cpu_give_member_by_members_bits(loaded, quantize):
    """float32 on the CPU and quantized: each member's own product on its rows, every attention head on
    its own, torch's layer norm as ``addcmul`` of its affine step: the same bits as member by member."""
    models, task = loaded("ensemble4")
    batches = sorted_batches(task, 8, 1000)
    opts = dict(decoder_options("var-batch"), quantize=quantize, output_layer="auto")
    ref = decode(lean_decoder(models, task, False, **opts), models, batches, SCHEDULERS["stream"])
    ours = decode(lean_decoder(models, task, True, **opts), models, batches, SCHEDULERS["stream"])
    assert len(ours) == 37 and differences(ref, ours, tolerance=0) == []


def test_stack_members_option(toy, capsys, caplog, monkeypatch):
    """``--stack-members auto|on|off`` (the API's ``stack_members``): auto keeps each member's compiled step on
    the CPU; on stacks them (the same lines printed); each says so in the log."""
    from fairseq_stream import runners
    from fairseq_stream.build import spec_from_options

    monkeypatch.setattr(runners, "_said", set())  # the log lines are said once a process
    assert [spec_from_options("var-batch", 5, {} if value is None else {"stack_members": value})[0].stack_members
            for value in (None, "auto", "on", "off")] == [None, None, True, False]
    common = [toy.data_bin, "--path", "{}:{}".format(toy.transformer, toy.transformer2), "--user-dir",
              "fairseq_stream", "--gen-subset", "test", "--batch-size", "8", "--search", "var-batch", "--cpu"]
    said = {"auto": "2 models, one after another: auto: each member's compiled step is faster on the CPU",
            "on": "2 models, stacked", "off": "2 models, one after another: --stack-members off"}
    printed = {}
    for value in ("auto", "on", "off"):
        with caplog.at_level("INFO"):
            generate_in_process(common + ["--stack-members", value])
        printed[value] = [line for line in capsys.readouterr().out.splitlines() if line[:2] == "H-"]
        assert any(said[value] in r.getMessage() for r in caplog.records), value
    assert len(printed["on"]) == 37 and printed["on"] == printed["off"] == printed["auto"]


def test_stack_members_on_is_never_dropped_silently(toy, loaded, capsys, caplog, monkeypatch):
    """With fixed on the batch generator (where auto keeps fairseq's runner) or --runner fairseq, on was
    ignored with no word; it now takes the lean runner there, as --quantize does, or is refused in one line."""
    from fairseq_stream import runners
    from fairseq_stream.errors import FairseqStreamError

    monkeypatch.setattr(runners, "_said", set())
    common = [toy.data_bin, "--path", "{}:{}".format(toy.transformer, toy.transformer2), "--user-dir",
              "fairseq_stream", "--gen-subset", "test", "--batch-size", "8", "--search", "fixed", "--cpu"]
    with caplog.at_level("INFO"):
        generate_in_process(common + ["--stack-members", "on"])
    assert any("using the lean runner (2 models, stacked" in r.getMessage() for r in caplog.records)
    assert len([line for line in capsys.readouterr().out.splitlines() if line[:2] == "H-"]) == 37
    for kind in ("fairseq", "rnn"):
        with pytest.raises(FairseqStreamError, match=r"^--stack-members on runs on our transformer runners "
                                                     r"\(lean, static\), not --runner {}$".format(kind)):
            build_runner(kind, loaded("ensemble")[0], stack_members=True)
    with pytest.raises(FairseqStreamError, match="these are fairseq LSTM models$"):
        build_runner("auto", loaded("lstm")[0], stack_members=True)


def test_stack_members_in_the_python_api(toy):
    """The API's ``stack_members``: the same translations stacked and not; a bad value refused before loading."""
    from fairseq_stream.api import Translator
    from fairseq_stream.errors import FairseqStreamError

    lines = (toy.raw / "test.src").read_text().splitlines()[:6]
    paths = [str(toy.transformer), str(toy.transformer2)]
    kwargs = dict(data=str(toy.data_bin), search="var-batch", cpu=True)
    texts = {value: [t.text for t in sorted(Translator(paths, stack_members=value, **kwargs).translate(lines),
                                            key=lambda t: t.index)]
             for value in ("on", "off")}
    assert texts["on"] == texts["off"] and len(texts["on"]) == 6 and all(texts["on"])
    with pytest.raises(FairseqStreamError, match="^stack_members must be one of .*, got 'yes'$"):
        Translator(paths, stack_members="yes", **kwargs)
