"""The compiled search loops (greedy for a batch, the beam for one sentence; the whole loop in C++) against the
decoder's Python loop: bitwise."""

import pytest
import torch

from conftest import sorted_batches
from fairseq_stream import compiled_search
from fairseq_stream.decoder import BeamDecoder
from fairseq_stream.ops import search_loop

pytestmark = pytest.mark.skipif(search_loop._extension() is None, reason="the compiled CPU extension is not built")


def python_loop(models, task, quantize="none", beam=1, **rules):
    dec = BeamDecoder(models, task.target_dictionary, beam_size=beam, runner="lean", output_layer="auto",
                      keep_reference=False, quantize=quantize, **rules)
    dec.compiled_loop = False  # the Python loop, the reference
    return dec


def compiled_words_and_positional_scores(dec, sample):
    """Each sentence's (words, positional scores) from the runner's compiled greedy loop."""
    src = sample["net_input"]["src_tokens"]
    found, steps = compiled_search.greedy_decode(
        dec.runner, sample["net_input"], bos=dec.eos, max_lens=dec.max_lengths(src).tolist(), min_len=dec.min_len,
        pad=dec.pad, eos=dec.eos, unk=dec.unk, unk_penalty=dec.unk_penalty)
    assert steps == [len(words) for (words, _), in found]
    out = []
    for (words, cumulative), in found:
        positional = cumulative.clone()
        positional[1:] = positional[1:] - positional[:-1]
        out.append((words, positional))
    return out


@pytest.mark.parametrize("quantize", ["none", "int8"])
@pytest.mark.parametrize("name", ["transformer", "ensemble"])
@pytest.mark.parametrize("rules", [{}, dict(min_len=6, max_len_a=0, max_len_b=7, unk_penalty=2.0, temperature=0.7),
                                   dict(max_len_a=0.5, max_len_b=2), dict(min_len=20, max_len_a=2, max_len_b=20)],
                         ids=["plain", "rules", "per-sentence-max-len", "past-the-first-cache"])
@pytest.mark.parametrize("batch", [1, 12])
def test_runner_loop_gives_the_python_loops_words_and_scores(loaded, name, quantize, rules, batch):
    models, task = loaded(name)
    dec = python_loop(models, task, quantize, **rules)
    for sample in sorted_batches(task, batch, 40, subset="valid"):
        with torch.no_grad():
            expected = dec.generate(models, sample)
        got = compiled_words_and_positional_scores(dec, sample)
        assert len(got) == len(expected)
        for (words, positional), hyps in zip(got, expected):
            assert torch.equal(words, hyps[0]["tokens"])
            assert torch.equal(positional, hyps[0]["positional_scores"])


def test_it_applies_to_compiled_float32_models(loaded, exact):
    models, task = loaded("transformer")
    dec = python_loop(models, task)
    two = sorted_batches(task, 2, 4)[0]
    found, steps = compiled_search.beam_decode(dec.runner, two["net_input"], k=2, n=4, bos=2, max_lens=[5, 5],
                                               min_len=1, pad=1, eos=2, unk=3, unk_penalty=0.0)
    assert len(found) == len(steps) == 2 and all(1 <= len(hyps) <= 2 for hyps in found)
    found, steps = compiled_search.greedy_decode(dec.runner, two["net_input"], bos=2, max_lens=[5, 5], min_len=1,
                                                 pad=1, eos=2, unk=3, unk_penalty=0.0)
    assert len(found) == len(steps) == 2
    models64, _ = exact("transformer")
    assert python_loop(models64, task).runner.lean[0].search_loop is None
    dec.runner.compiled_step = False
    one = sorted_batches(task, 1, 1)[0]
    assert compiled_search.greedy_decode(dec.runner, one["net_input"], bos=2, max_lens=[5], min_len=1, pad=1, eos=2,
                                         unk=3, unk_penalty=0.0) is None


@pytest.mark.parametrize("beam, rules, batch", [
    (1, {}, 1), (5, {}, 1), (3, dict(min_len=4, max_len_a=0, max_len_b=6, unk_penalty=1.5, temperature=0.8,
                                     len_penalty=1.3), 1),
    (1, {}, 8), (1, dict(min_len=3, max_len_a=0.6, max_len_b=1, unk_penalty=1.5, len_penalty=0.7), 8),
    (5, {}, 8), (4, dict(min_len=3, max_len_a=0.6, max_len_b=1, unk_penalty=1.5, len_penalty=0.7), 8),
    (3, dict(min_len=20, max_len_a=2, max_len_b=20), 12)],
    ids=["greedy", "beam5", "beam3-rules", "greedy-batch", "greedy-batch-rules", "beam5-batch", "beam4-batch-rules",
         "beam3-batch-past-the-first-cache"])
@pytest.mark.parametrize("quantize", ["none", "int8"])
@pytest.mark.parametrize("name", ["transformer", "ensemble"])
def test_decoder_gives_the_python_loops_hypotheses(loaded, monkeypatch, name, quantize, beam, rules, batch):
    from fairseq_stream.runners.lean import LeanRunner

    models, task = loaded(name)
    reference = python_loop(models, task, quantize, beam, **rules)
    ours = python_loop(models, task, quantize, beam, **rules)
    ours.compiled_loop = True
    loop = "greedy_decode" if beam == 1 else "beam_decode"
    calls, counted = [], getattr(compiled_search, loop)
    monkeypatch.setattr(compiled_search, loop, lambda *a, **k: calls.append(1) or counted(*a, **k))
    batches = sorted_batches(task, batch, 30, subset="valid")
    for sample in batches:
        with torch.no_grad():
            expected, got = reference.generate(models, sample), ours.generate(models, sample)
        assert len(got) == len(expected) == sample["id"].numel()
        for mine_n, theirs_n in zip(got, expected):
            assert len(mine_n) == len(theirs_n)
            for mine, theirs in zip(mine_n, theirs_n):
                for key in ("tokens", "positional_scores", "score"):
                    assert torch.equal(mine[key], theirs[key]), key
    assert len(calls) == len(batches)
    assert (ours.stats.timesteps, ours.stats.expansions) == (reference.stats.timesteps, reference.stats.expansions)


def test_fairseq_generate_prints_the_python_loops_lines(toy, capsys, monkeypatch):
    from conftest import generate_in_process
    from fairseq_stream.runners.lean import LeanRunner

    for search in (["--search", "greedy", "--quantize", "int8", "--batch-size", "1"],
                   ["--search", "fixed", "--beam", "4", "--nbest", "2", "--runner", "lean", "--batch-size", "1"],
                   ["--search", "greedy", "--batch-size", "16"],
                   ["--search", "fixed", "--beam", "5", "--nbest", "3", "--quantize", "int8", "--batch-size", "16"]):
        argv = [toy.data_bin, "--path", toy.transformer, "--user-dir", "fairseq_stream", "--gen-subset", "test",
                "--cpu"] + search
        generate_in_process(argv)
        compiled = [line for line in capsys.readouterr().out.splitlines() if line[:2] in ("H-", "P-", "D-")]
        with monkeypatch.context() as patched:
            patched.setattr(LeanRunner, "compiled_loop_inputs", lambda *a, **k: None)
            generate_in_process(argv)
        python = [line for line in capsys.readouterr().out.splitlines() if line[:2] in ("H-", "P-", "D-")]
        assert compiled == python and len(compiled) >= 3 * 37


def test_an_empty_source_keeps_the_python_loop(loaded):
    models, task = loaded("transformer")
    dec = python_loop(models, task)
    dec.compiled_loop = True
    d = task.target_dictionary
    eos, pad, word = d.eos(), d.pad(), d.nspecial  # the first real word
    sample = {"net_input": {"src_tokens": torch.tensor([[eos]]), "src_lengths": torch.tensor([1])}}
    batch = {"net_input": {"src_tokens": torch.tensor([[word, eos], [pad, eos]]), "src_lengths": torch.tensor([2, 1])}}
    with torch.no_grad():
        assert dec._search_in_one_call(sample["net_input"], None) is None
        assert dec._search_in_one_call(batch["net_input"], None) is None
        (hyps,) = dec.generate(models, sample)
        both = dec.generate(models, batch)
    assert hyps[0]["tokens"].tolist() == [eos]
    assert len(both) == 2 and both[1][0]["tokens"].tolist() == [eos]


@pytest.mark.parametrize("beam", [1, 4])
def test_a_signal_is_handled_between_steps_not_after_the_batch(loaded, monkeypatch, beam):
    """Ctrl-C reaches Python while a compiled batch runs: a timer's handler set off 5 ms into the call runs
    before the call returns (the loop checks for signals between steps), not after it."""
    import signal
    import time

    models, task = loaded("transformer")
    dec = python_loop(models, task, beam=beam, min_len=120, max_len_a=0, max_len_b=130)
    dec.compiled_loop = True
    name = "greedy_decode" if beam == 1 else "beam_decode"
    module, times = search_loop._extension(), {}
    compiled = getattr(module, name)

    def timed(*args):
        signal.setitimer(signal.ITIMER_REAL, 0.005)
        times["in"] = time.perf_counter()
        try:
            return compiled(*args)
        finally:
            times["out"] = time.perf_counter()

    monkeypatch.setattr(module, name, timed)
    previous = signal.signal(signal.SIGALRM, lambda *_: times.setdefault("handler", time.perf_counter()))
    try:
        with torch.no_grad():
            dec.generate(models, sorted_batches(task, 16, 16, subset="valid")[0])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert times["in"] < times["handler"] < times["out"]


def test_ctrl_c_ends_a_compiled_batch_with_keyboard_interrupt(loaded, monkeypatch):
    import signal

    models, task = loaded("transformer")
    dec = python_loop(models, task, min_len=120, max_len_a=0, max_len_b=130)
    dec.compiled_loop = True
    module = search_loop._extension()
    compiled = module.greedy_decode

    def interrupted(*args):
        signal.setitimer(signal.ITIMER_REAL, 0.005)
        return compiled(*args)

    def ctrl_c(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(module, "greedy_decode", interrupted)
    previous = signal.signal(signal.SIGALRM, ctrl_c)
    try:
        with pytest.raises(KeyboardInterrupt), torch.no_grad():
            dec.generate(models, sorted_batches(task, 16, 16, subset="valid")[0])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("beam, batch", [(1, 1), (5, 1), (1, 4), (3, 2)])
def test_prenorm_model_gives_the_python_loops_hypotheses(loaded, beam, batch):
    """A pre-norm float32 model with learned positions, an embedding norm and a final norm (random weights): one
    sentence's rows run the step on kept buffers (search_loop_cpu.cpp's RawStep), which places the norms itself."""
    from test_lean_runner import random_transformer

    _, task = loaded("transformer")
    model = random_transformer(
        task, "transformer", encoder_embed_dim=64, decoder_embed_dim=64, encoder_ffn_embed_dim=128,
        decoder_ffn_embed_dim=128, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_normalize_before=True, decoder_normalize_before=True,
        decoder_learned_pos=True, encoder_learned_pos=True, layernorm_embedding=True, no_scale_embedding=True)
    models = [model]
    rules = dict(max_len_a=0, max_len_b=9)  # random weights seldom end a sentence by themselves
    reference, ours = python_loop(models, task, beam=beam, **rules), python_loop(models, task, beam=beam, **rules)
    ours.compiled_loop = True
    for sample in sorted_batches(task, batch, 8, subset="valid"):
        with torch.no_grad():
            expected, got = reference.generate(models, sample), ours.generate(models, sample)
        for mine_n, theirs_n in zip(got, expected, strict=True):
            for mine, theirs in zip(mine_n, theirs_n, strict=True):
                for key in ("tokens", "positional_scores", "score"):
                    assert torch.equal(mine[key], theirs[key]), key


def test_the_kept_buffer_step_calls_atens_layer_norm_kernel():
    """The step on kept buffers calls ATen's layer-norm kernel on its buffers (layer_norm_kernel_cpu.cpp):
    looked up by name in torch, and taken only where it gives native_layer_norm's bits. Where torch renamed
    it or picks kernels by another rule, the step still gives the same bits (through native_layer_norm) but
    is about 4% slower one sentence at a time; this says so."""
    assert search_loop._extension().aten_layer_norm_kernel_found()
