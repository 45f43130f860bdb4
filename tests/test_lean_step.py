"""The compiled lean step (all layers of a step in one call) against the Python step: bitwise, in real decoding."""

import pytest

from conftest import decode, decoder_options, differences, sorted_batches
from fairseq_stream.decoder import BeamDecoder
from fairseq_stream.ops import lean_step
from test_lean_runner import SCHEDULERS, random_transformer

pytestmark = pytest.mark.skipif(not lean_step.available(), reason="the compiled CPU extension is not built")


def decode_both(models, task, search, scheduler, monkeypatch, limit=24, **opts):
    """Python step and compiled step over the same batches; the compiled one must have run."""
    batches = sorted_batches(task, 8, limit)
    options = dict(decoder_options(search), **opts)
    results, calls = [], []
    counted = lean_step.lean_layers

    def counting(*args):
        calls.append(1)
        return counted(*args)

    monkeypatch.setattr(lean_step, "lean_layers", counting)
    for compiled in (False, True):
        dec = BeamDecoder(models, task.target_dictionary, runner="lean", **options)
        dec.runner.compiled_step = compiled
        results.append(decode(dec, models, batches, SCHEDULERS[scheduler]))
        assert bool(calls) == compiled
    return results


@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
@pytest.mark.parametrize("search", ["greedy", "fixed", "var-batch"])
@pytest.mark.parametrize("name", ["transformer", "ensemble"])
def test_same_bits_as_the_python_step_float32(loaded, monkeypatch, name, search, scheduler):
    models, task = loaded(name)
    python, compiled = decode_both(models, task, search, scheduler, monkeypatch)
    assert differences(python, compiled, tolerance=0) == []


@pytest.mark.parametrize("scheduler", ["batch", "fifo"])
def test_same_bits_pre_norm_gelu_learned_positions_float64(exact, monkeypatch, scheduler):
    _, task = exact("transformer")
    model = random_transformer(
        task, "transformer", encoder_embed_dim=64, decoder_embed_dim=64, encoder_ffn_embed_dim=128,
        decoder_ffn_embed_dim=128, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_normalize_before=True, decoder_normalize_before=True,
        decoder_learned_pos=True, encoder_learned_pos=True, layernorm_embedding=True, no_scale_embedding=True,
        activation_fn="gelu").double()
    python, compiled = decode_both([model], task, "var-batch", scheduler, monkeypatch, limit=16, max_len_a=0,
                                   max_len_b=12)
    assert differences(python, compiled, tolerance=0) == []


def test_layers_it_cannot_describe_keep_the_python_step(exact):
    from fairseq_stream.runners.lean import LeanRunner

    _, task = exact("transformer")
    model = random_transformer(task, "transformer", encoder_embed_dim=32, decoder_embed_dim=32,
                               encoder_ffn_embed_dim=64, decoder_ffn_embed_dim=64, encoder_layers=1,
                               decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                               activation_fn="tanh")
    assert LeanRunner([model]).lean[0].compiled is None


@pytest.mark.parametrize("variant, block", [("hgj", 2), ("pgj", 3)])
def test_jacobi_window_same_bits_as_the_python_window(loaded, monkeypatch, variant, block):
    from fairseq_stream.jacobi.decoder import JacobiDecoder
    from test_jacobi import greedy_decoder, run

    models, task = loaded("ensemble")
    batches = sorted_batches(task, 8, 24)
    calls, counted = [], lean_step.lean_window_layers
    monkeypatch.setattr(lean_step, "lean_window_layers", lambda *a: calls.append(1) or counted(*a))
    results = []
    for compiled in (False, True):
        greedy = greedy_decoder(models, task)
        greedy.runner.compiled_step = compiled
        # call_cost: windows at 8 rows, not greedy's step.
        results.append(run(JacobiDecoder(greedy, variant, block, "ngram", call_cost=1000), models, batches))
        assert bool(calls) == compiled
    assert differences(results[0], results[1], tolerance=0) == []
