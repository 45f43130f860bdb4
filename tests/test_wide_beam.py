"""A beam as wide as the vocabulary (issue 49): every search of ours decodes it as fairseq does.

fairseq caps the beam at V - 1 (PAD is never a word) and at step 0 extends
one slot: with EOS banned (``--min-len``, 1 by default) fewer words than slots
are left, and a slot takes a -inf candidate that must never lead anywhere;
with ``--min-len 0`` the beam must take an EOS, which fairseq finalizes, keeps
on the beam and then ignores a rank for. Each path (fairseq's and the lean
runner, the torch and the fused output layer, the Python loop and the
compiled search loop, one sentence and a batch) is compared with fairseq's
SequenceGenerator: bitwise on fairseq's runner and output layer, to 1e-9 in
float64 elsewhere.
"""

import pytest
import torch
from fairseq.sequence_generator import SequenceGenerator

from conftest import decoder_options, differences
from fairseq_stream import compiled_search
from fairseq_stream.decoder import BeamDecoder
from fairseq_stream.ops import output_layer, search_loop
from fairseq_stream.schedule.pool import StreamPool

needs_cpu_kernel = pytest.mark.skipif(output_layer.auto_backend("cpu") != "cpu",
                                      reason="the CPU output-layer kernel is not built")


def samples(task, n=2):
    """The ``n`` shortest test sentences as one batch, then one by one: {name: sample}."""
    dataset = task.dataset("test")
    ids = sorted(range(len(dataset)), key=lambda i: (dataset.src_sizes[i], i))[:n]
    out = {"batch": dataset.collater([dataset[i] for i in ids])}
    out.update(("one-{}".format(i), dataset.collater([dataset[i]])) for i in ids)
    return out


def run(generator, models, task):
    """{(sample name, sentence id): n-best} of ``generator`` over :func:`samples`."""
    out = {}
    with torch.no_grad():
        for name, sample in samples(task).items():
            for sid, hyps in zip(sample["id"].tolist(), generator.generate(models, sample)):
                out[(name, sid)] = hyps
    return out


def words_only(out, task):
    """The sentences with a hypothesis that holds PAD, or EOS before its end, or a score that is not finite."""
    d = task.target_dictionary
    return [key for key, hyps in out.items()
            if any(d.pad() in h["tokens"].tolist() or d.eos() in h["tokens"][:-1].tolist()
                   or not torch.isfinite(h["positional_scores"]).all() for h in hyps)]


@pytest.mark.parametrize("over, min_len", [(0, 1), (1, 1), (1000, 1), (0, 0)],
                         ids=["V-1", "V", "above", "V-1-min-len-0"])
def test_fixed_equals_sequence_generator_bitwise(loaded, over, min_len):
    """fairseq's runner and output layer (``--search fixed``'s promise), beam V - 1, V and above."""
    models, task = loaded("transformer")
    beam = len(task.target_dictionary) - 1 + over
    ours = BeamDecoder(models, task.target_dictionary, beam_size=beam, min_len=min_len)
    assert ours.beam_size == len(task.target_dictionary) - 1
    expected = run(SequenceGenerator(models, task.target_dictionary, beam_size=beam, min_len=min_len), models, task)
    got = run(ours, models, task)
    assert differences(expected, got, tolerance=0) == []
    if min_len:
        assert words_only(got, task) == []


@needs_cpu_kernel
@pytest.mark.parametrize("min_len", [1, 0])
@pytest.mark.parametrize("runner, layer", [("fairseq", "fused"), ("lean", "torch"), ("lean", "fused")])
def test_every_runner_and_output_layer_float64(exact, float64_fairseq, runner, layer, min_len):
    models, task = exact("transformer")
    beam = len(task.target_dictionary) - 1
    expected = run(SequenceGenerator(models, task.target_dictionary, beam_size=beam, min_len=min_len), models, task)
    ours = BeamDecoder(models, task.target_dictionary, beam_size=beam, min_len=min_len, runner=runner,
                       output_layer=layer, keep_reference=False)
    assert ours.runner.name == runner and ours.fused == (layer == "fused")
    assert differences(expected, run(ours, models, task)) == []


@pytest.mark.skipif(search_loop._extension() is None, reason="the compiled CPU extension is not built")
@pytest.mark.parametrize("below", [3, 2, 1])
def test_compiled_loop_gives_the_python_loops_hypotheses(loaded, monkeypatch, below):
    """float32, one sentence and a batch; the compiled loop runs up to V - 3 slots, the Python loop above."""
    models, task = loaded("transformer")
    beam = len(task.target_dictionary) - below
    dec = BeamDecoder(models, task.target_dictionary, beam_size=beam, runner="lean", output_layer="auto",
                      keep_reference=False)
    dec.compiled_loop = False
    expected = run(dec, models, task)
    calls = []
    decode = compiled_search.beam_decode
    monkeypatch.setattr(compiled_search, "beam_decode", lambda *a, **kw: calls.append(1) or decode(*a, **kw))
    dec.compiled_loop = True
    got = run(dec, models, task)
    assert bool(calls) == (below >= 3)
    assert differences(expected, got, tolerance=0) == []
    assert words_only(got, task) == []


@pytest.mark.parametrize("scheduler", [None, dict(pool_size=2, eps=1 / 6, order="shortest")], ids=["batch", "stream"])
@pytest.mark.parametrize("search", ["fixed", "fixed-stay", "var-batch", "var-fairseq"])
def test_every_search_keeps_to_words(loaded, search, scheduler):
    """Each search of ours at beam V - 1 under fairseq's batches and the stream pool: hypotheses of words."""
    models, task = loaded("transformer")
    opts = dict(decoder_options(search), beam_size=len(task.target_dictionary) - 1)
    dec = BeamDecoder(models, task.target_dictionary, runner="lean", output_layer="auto", keep_reference=False,
                      **opts)
    out = {}
    with torch.no_grad():
        for name, sample in samples(task).items():
            if scheduler is None:
                found = zip(sample["id"].tolist(), dec.generate(models, sample))
            else:
                found = StreamPool(dec, **scheduler).run([dec.open(sample["net_input"], ids=sample["id"])])
            out.update(((name, sid), hyps) for sid, hyps in found)
    assert len(out) == len(samples(task)) + 1
    assert words_only(out, task) == []
