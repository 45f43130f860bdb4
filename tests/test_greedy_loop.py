"""The compiled greedy loop (one sentence, the whole loop in C++) against the decoder's Python loop: bitwise."""

import pytest
import torch

from conftest import sorted_batches
from fairseq_stream.decoder import BeamDecoder
from fairseq_stream.ops import greedy_loop

pytestmark = pytest.mark.skipif(greedy_loop._extension() is None, reason="the compiled CPU extension is not built")

torch.set_num_threads(1)


def python_loop(models, task, quantize="none", **rules):
    dec = BeamDecoder(models, task.target_dictionary, beam_size=1, runner="lean", output_layer="auto",
                      keep_reference=False, quantize=quantize, **rules)
    dec.greedy_loop = False  # the Python loop, the reference
    return dec


def compiled_words_and_positional_scores(dec, sample):
    src = sample["net_input"]["src_tokens"]
    words, cumulative = dec.runner.greedy_decode(
        sample["net_input"], bos=dec.eos, max_len=int(dec.max_lengths(src)[0]), min_len=dec.min_len, pad=dec.pad,
        eos=dec.eos, unk=dec.unk, unk_penalty=dec.unk_penalty)
    positional = cumulative.clone()
    positional[1:] = positional[1:] - positional[:-1]
    return words, positional


@pytest.mark.parametrize("quantize", ["none", "int8"])
@pytest.mark.parametrize("name", ["transformer", "ensemble"])
@pytest.mark.parametrize("rules", [{}, dict(min_len=6, max_len_a=0, max_len_b=7, unk_penalty=2.0, temperature=0.7)],
                         ids=["plain", "rules"])
def test_runner_loop_gives_the_python_loops_words_and_scores(loaded, name, quantize, rules):
    models, task = loaded(name)
    dec = python_loop(models, task, quantize, **rules)
    for sample in sorted_batches(task, 1, 40, subset="valid"):
        with torch.no_grad():
            expected = dec.generate(models, sample)[0][0]
        words, positional = compiled_words_and_positional_scores(dec, sample)
        assert torch.equal(words, expected["tokens"])
        assert torch.equal(positional, expected["positional_scores"])


def test_it_applies_only_to_one_sentence_of_compiled_float32_models(loaded, exact):
    models, task = loaded("transformer")
    dec = python_loop(models, task)
    two = sorted_batches(task, 2, 4)[0]
    assert dec.runner.greedy_decode(two["net_input"], bos=2, max_len=5, min_len=1, pad=1, eos=2, unk=3,
                                    unk_penalty=0.0) is None
    models64, _ = exact("transformer")
    assert python_loop(models64, task).runner.lean[0].greedy_loop is None
    dec.runner.compiled_step = False
    one = sorted_batches(task, 1, 1)[0]
    assert dec.runner.greedy_decode(one["net_input"], bos=2, max_len=5, min_len=1, pad=1, eos=2, unk=3,
                                    unk_penalty=0.0) is None
