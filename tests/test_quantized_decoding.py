"""--quantize int8|int16 in real decoding: every path of the lean runner gives the same bits, every scheduler
the batch's output, Jacobi greedy's tokens; the options, the command line and the API."""

import sys

import pytest
import torch

from conftest import decode, decoder_options, differences, generate_in_process, hypotheses, run_tool, sorted_batches
from fairseq_stream.decoder import BeamDecoder
from fairseq_stream.errors import FairseqStreamError
from fairseq_stream.ops import lean_step, quantized_linear
from test_lean_runner import SCHEDULERS

pytestmark = pytest.mark.skipif(not quantized_linear.kernels(), reason="the compiled CPU extension is not built")


def quantized_decoder(models, task, search, quantize="int8", **opts):
    return BeamDecoder(models, task.target_dictionary, runner="lean", output_layer="auto", keep_reference=False,
                       quantize=quantize, **dict(decoder_options(search), **opts))


@pytest.mark.parametrize("quantize", ["int8w8", "int8w7", "int16"])
@pytest.mark.parametrize("search", ["greedy", "var-batch"])
@pytest.mark.parametrize("name", ["transformer", "ensemble"])
def test_compiled_step_same_bits_as_the_python_step(loaded, monkeypatch, name, search, quantize):
    models, task = loaded(name)
    batches = sorted_batches(task, 8, 16)
    calls, counted = [], lean_step.lean_layers
    monkeypatch.setattr(lean_step, "lean_layers", lambda *a: calls.append(1) or counted(*a))
    results = []
    for compiled in (False, True):
        dec = quantized_decoder(models, task, search, quantize)
        dec.runner.compiled_step = compiled
        dec.compiled_loop = False  # the step in the Python loop; tests/test_search_loop.py checks the compiled loop
        results.append(decode(dec, models, batches, None))
        assert bool(calls) == compiled
    assert differences(results[0], results[1], tolerance=0) == []


@pytest.mark.parametrize("scheduler", sorted(s for s in SCHEDULERS if s != "batch"))
@pytest.mark.parametrize("search, quantize", [("greedy", "int8"), ("fixed", "int8w8"), ("fixed", "int8w7"),
                                              ("var-batch", "int8")])
def test_every_scheduler_gives_the_batch_output_bit_for_bit(loaded, search, quantize, scheduler):
    """Rows are quantized one by one and summed exactly: which rows share a call changes no bit."""
    models, task = loaded("ensemble")
    batches = sorted_batches(task, 8, 24)
    batch = decode(quantized_decoder(models, task, search, quantize), models, batches, None)
    ours = decode(quantized_decoder(models, task, search, quantize), models, batches, SCHEDULERS[scheduler])
    assert differences(batch, ours, tolerance=0) == []


@pytest.mark.parametrize("variant, block", [("hgj", 3), ("pgj", 2)])
def test_jacobi_gives_quantized_greedys_output_bit_for_bit(loaded, variant, block):
    from fairseq_stream.jacobi.decoder import JacobiDecoder

    models, task = loaded("transformer")
    batches = sorted_batches(task, 8, 24)
    greedy = decode(quantized_decoder(models, task, "greedy"), models, batches, None)
    jacobi = JacobiDecoder(quantized_decoder(models, task, "greedy"), variant, block, "ngram", call_cost=1000)
    assert differences(greedy, decode(jacobi, models, batches, None), tolerance=0) == []


def forced_agreement(ours, reference, batches, translations, task):
    """(steps where ``ours`` and ``reference`` pick the same best next word, steps): every step of
    ``translations`` (id -> tokens, EOS last) run on its own prefix in both, as teacher forcing does."""
    pad, eos = task.target_dictionary.pad(), task.target_dictionary.eos()
    agree = total = 0
    with torch.no_grad():
        for b in batches:
            wanted = [translations[i] for i in b["id"].tolist()]
            length = max(t.numel() for t in wanted)
            prefixes = torch.full((len(wanted), length + 1), pad, dtype=torch.long)
            prefixes[:, 0] = eos
            for row, t in enumerate(wanted):
                prefixes[row, 1:t.numel() + 1] = t
            states = [dec.runner.start(b["net_input"], 1) for dec in (ours, reference)]
            for step in range(length):
                best = [dec.runner.step(state, prefixes[:, : step + 1])[0].argmax(dim=1)
                        for dec, state in zip((ours, reference), states)]
                running = torch.tensor([t.numel() > step for t in wanted])
                total += int(running.sum())
                agree += int((best[0].eq(best[1]) & running).sum())
    return agree, total


def test_int16_stays_close_to_float_and_int8_near_it(loaded):
    """A sanity floor on the toy (the accuracy targets are the Multi30k benchmark's): the quantized model's
    best next word is float's at nearly every step of float's greedy translations (the 200 valid sentences).

    Counted per step, both models on float's prefix (teacher forcing), not
    per whole translation: one flipped step changes a whole greedy output, so
    the share of identical outputs follows how sure the toy is of its words,
    which differs between toys (the toy is trained per machine: this
    machine's kept 125 and 119 of 200 in int8w8 and int8w7, a toy trained
    under ATEN_CPU_CAPABILITY=avx2 104 in int8w7, below the 55% floor this
    test had). Per step these toys' int16 agree with float on 99.9% of about
    3300 steps, int8w8 on 96.4-96.6%, int8w7 on 95.6-96.3%: the floors allow
    over twice int8's disagreement and fifteen times int16's, and a broken
    product (a lost bias: 74%, a scale 10% off: 80%) falls below them.
    """
    models, task = loaded("transformer")
    batches = sorted_batches(task, 16, 200, subset="valid")
    reference = quantized_decoder(models, task, "greedy", "none")
    translations = {s: h[0]["tokens"] for s, h in decode(reference, models, batches, None).items()}
    for quantize, floor in (("int16", 0.99), ("int8w8", 0.9), ("int8w7", 0.9)):
        agree, total = forced_agreement(quantized_decoder(models, task, "greedy", quantize), reference, batches,
                                        translations, task)
        assert total > 2000 and agree >= floor * total, (quantize, agree, total)


def test_lstm_takes_int16_on_the_rnn_runner_and_refuses_int8(loaded):
    from fairseq_stream.runners.rnn import RnnRunner

    models, task = loaded("lstm")
    dec = BeamDecoder(models, task.target_dictionary, runner="auto", quantize="int16", beam_size=1)
    assert isinstance(dec.runner, RnnRunner) and dec.runner.options.int16
    with pytest.raises(FairseqStreamError, match="int8 is for transformers"):
        BeamDecoder(models, task.target_dictionary, runner="auto", quantize="int8", beam_size=1)


def test_models_not_float32_on_the_cpu_are_refused_in_one_line(loaded):
    import copy

    models, task = loaded("transformer")
    with pytest.raises(FairseqStreamError, match="float32 models on the CPU.*float64"):
        quantized_decoder([copy.deepcopy(models[0]).double()], task, "greedy")


@pytest.mark.parametrize("argv, message", [
    (["--quantize", "int4"], "invalid choice"),
    (["--quantize", "int8", "--runner", "fairseq"], "not --runner fairseq"),
])
def test_bad_quantize_options_are_one_line_errors(toy, argv, message):
    proc = run_tool(["fairseq-generate", toy.data_bin, "--path", toy.transformer, "--user-dir", "fairseq_stream",
                     "--search", "greedy", "--gen-subset", "test", "--cpu"] + argv, check=False)
    assert proc.returncode != 0
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_command_line_and_preset_decode_with_int8(toy, capsys):
    common = [toy.data_bin, "--path", toy.transformer, "--user-dir", "fairseq_stream", "--gen-subset", "test",
              "--batch-size", "8", "--search", "var-batch", "--beam", "5"]
    generate_in_process(common + ["--quantize", "int8", "--cpu"])
    typed = hypotheses(capsys.readouterr().out)
    assert len(typed) == len(toy.raw.joinpath("test.src").read_text().splitlines())
    proc = run_tool(["fairseq-generate"] + common + ["--preset", "cpu-int8"])
    assert hypotheses(proc.stdout) == typed
    form = quantized_linear.resolve("int8")
    assert "{} products ({}-bit weights): {} kernel".format(
        form, form[-1], quantized_linear.kernel("int8")) in proc.stderr


def test_aten_cpu_capability_avx2_runs_an_avx2_cpus_kernels_and_the_same_translations(toy, capsys):
    """ATEN_CPU_CAPABILITY=avx2 caps our kernels as it caps torch's (csrc/cpu/cpu_isa_cpu.h), so an AVX-512
    machine decodes on the kernels an AVX2-only CPU runs. There int8 takes 7-bit weights (its vpmaddubsw
    kernel), and int8w7's integer sums are the same on every kernel: the translations of int8w7 here."""
    common = [toy.data_bin, "--path", toy.transformer, "--user-dir", "fairseq_stream", "--gen-subset", "test",
              "--batch-size", "8", "--search", "fixed", "--beam", "5", "--cpu"]
    capped = "avx2" if "avx2" in quantized_linear.kernels("int8w8") else "portable"
    form = "int8w7" if capped == "avx2" else "int8w8"
    generate_in_process(common + ["--quantize", form])
    ours = hypotheses(capsys.readouterr().out)
    proc = run_tool(["fairseq-generate"] + common + ["--quantize", "int8"], env={"ATEN_CPU_CAPABILITY": "avx2"})
    kernel = "avx2w7" if capped == "avx2" else "portable"
    assert "{} products ({}-bit weights): {} kernel".format(form, form[-1], kernel) in proc.stderr
    assert hypotheses(proc.stdout) == ours
    probe = ("from fairseq_stream.ops import quantized_linear as q, product as p; "
             "print(q.kernels('int8w8'), q.kernels('int16'), repr(p.skinny_kernel()))")
    listed = run_tool([sys.executable, "-c", probe], env={"ATEN_CPU_CAPABILITY": "avx2"}).stdout.strip()
    assert "avx512" not in listed and listed.endswith(" 'avx2'" if capped == "avx2" else " ''"), listed


def test_api_takes_quantize(toy):
    from fairseq_stream.api import Translator

    lines = toy.raw.joinpath("test.src").read_text().splitlines()[:6]
    kwargs = dict(data=str(toy.data_bin), search="greedy", cpu=True)
    int8 = list(Translator([str(toy.transformer)], quantize="int8", **kwargs).translate(lines))
    assert sorted(t.index for t in int8) == list(range(6)) and all(t.text for t in int8)
    # Refused by its type (a choice), before loading: the keyword's name, not a flag's.
    with pytest.raises(FairseqStreamError, match="^quantize must be one of .*, got 'int4'$"):
        Translator([str(toy.transformer)], quantize="int4", **kwargs)


def test_the_float_weights_the_quantized_products_replace_are_released(loaded):
    """build_decoder owns its models: their float projections go, the output stays the same."""
    import copy

    from fairseq_stream.build import build_decoder, spec_from_options

    models, task = loaded("transformer")
    own = [copy.deepcopy(models[0])]
    spec, _ = spec_from_options("var-batch", 5, {"quantize": "int8"})
    dec = build_decoder(spec, task, own)
    sizes = {name: p.numel() for name, p in own[0].named_parameters()}
    assert sizes["decoder.layers.0.fc1.weight"] == 0 and sizes["encoder.layers.0.self_attn.q_proj.weight"] == 0
    assert own[0].decoder.embed_tokens.weight.numel() > 0 and sizes["decoder.layers.0.fc1.bias"] > 0
    batches = sorted_batches(task, 8, 16)
    kept = quantized_decoder(models, task, "var-batch")
    assert differences(decode(kept, models, batches, None), decode(dec, own, batches, None), tolerance=0) == []
    with pytest.raises(FairseqStreamError, match="released by an earlier --quantize decoder"):
        build_decoder(spec, task, own)


def test_topup_prints_what_batch_prints_in_int8(toy, capsys):
    """Top-up changes when rows run, and int8 rows do not depend on their company: the same lines."""
    common = [toy.data_bin, "--path", toy.transformer, "--user-dir", "fairseq_stream", "--gen-subset", "test",
              "--batch-size", "8", "--search", "fixed", "--beam", "5", "--quantize", "int8", "--cpu"]
    generate_in_process(common)
    batch = [line for line in capsys.readouterr().out.splitlines() if line[:2] in ("H-", "P-")]
    generate_in_process(common + ["--generator", "topup"])
    topup = [line for line in capsys.readouterr().out.splitlines() if line[:2] in ("H-", "P-")]
    assert sorted(topup) == sorted(batch) and len(batch) == 2 * 37
