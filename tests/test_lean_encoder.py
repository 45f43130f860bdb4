"""The lean encoder (sources packed without padding, one compiled call) against fairseq's encoder.

End to end, the lean runner's n-best lists equal the fairseq runner's in
float64 with the lean encoder on (tests/test_lean_runner.py, every search and
scheduler). Here the encoder keys and values themselves are compared with
those computed from fairseq's encoder, on batches in input order (sources of
different lengths, padded), for both attention paths of ``sentence_attention``
(loops per token, batched products), on the toy transformer, a pre-norm model
with learned positions, gelu and an embedding layer norm, and a model of the
WMT'19 big architecture.
"""

import pytest
import torch

from fairseq_stream.runners import lean_encoder
from fairseq_stream.runners.lean_model import LeanModel
from test_lean_runner import models64, random_transformer  # noqa: F401  (a fixture, and its helper)
from test_threads import kernel_threads, module, needs_kernels, skip_without  # noqa: F401  (a fixture, helpers)

SENTENCES = {"transformer": 24, "prenorm-learned": 16, "wmt19-big": 3}


def unmasked(keys, mask, sentence):
    """One sentence's keys or values (heads, positions, head_dim) at its unmasked positions."""
    if mask is None:
        return keys[sentence]
    return keys[sentence][:, mask[sentence, 0, 0] == 0]


def assert_same_keys(ours, ref, tolerance=1e-10):
    assert ours.sentences == ref.sentences
    for layer in range(len(ref.keys)):
        for s in range(ref.sentences):
            for mine, theirs in ((ours.keys, ref.keys), (ours.values, ref.values)):
                a, b = unmasked(mine[layer], ours.mask, s), unmasked(theirs[layer], ref.mask, s)
                assert a.shape == b.shape
                assert torch.allclose(a, b, rtol=0, atol=tolerance), (layer, s, (a - b).abs().max().item())


@pytest.mark.parametrize("dense_from", [1, 10 ** 6], ids=["batched-products", "loops"])
@pytest.mark.parametrize("name", sorted(SENTENCES))
def test_packed_keys_equal_fairseq_encoders_float64(models64, name, dense_from, monkeypatch):  # noqa: F811
    models, task = models64(name)
    lean = LeanModel(models[0], prepack=False)
    assert lean.encoder is not None and lean.encoder.compiled is not None
    monkeypatch.setattr(lean_encoder, "DENSE_FROM", dense_from)
    dataset = task.dataset("valid")
    n = SENTENCES[name]
    batch = dataset.collater([dataset[i] for i in range(n)])  # input order: lengths differ, padded on the left
    lengths = batch["net_input"]["src_lengths"]
    assert len(set(lengths.tolist())) > 1
    with torch.no_grad():
        ref = lean.encode(batch["net_input"], packed=False)
        states, _ = lean.encoder.encode(batch["net_input"]["src_tokens"], dense_from)
        ours = lean._encode_packed(batch["net_input"]["src_tokens"])
    assert states.size(0) == int(lengths.sum())
    assert ours.mask is not None and ours.source_length == int(lengths.max())
    assert_same_keys(ours, ref)


def test_a_source_of_eos_alone_among_longer_ones(exact):
    """An empty input line reaches the encoder as EOS alone: its keys are its own, the batch's padding masked."""
    models, task = exact("transformer")
    lean = LeanModel(models[0], prepack=False)
    d = task.source_dictionary
    sources = [torch.tensor([d.eos()]), task.dataset("test")[0]["source"], torch.tensor([d.index("a"), d.eos()])]
    dataset = task.build_dataset_for_inference(sources, [s.numel() for s in sources])
    batch = dataset.collater([dataset[i] for i in range(len(sources))])
    with torch.no_grad():
        ref = lean.encode(batch["net_input"], packed=False)
        ours = lean.encode(batch["net_input"])
    alone = batch["id"].tolist().index(0)  # the collater sorts by length
    assert ours.mask is not None and bool(torch.isinf(ours.mask[alone, 0, 0, 1:]).all())
    assert_same_keys(ours, ref)


def test_an_encoder_with_its_own_forward_keeps_fairseqs(exact):
    """A subclass that changes the encoder's forward: the lean encoder declines it, and fairseq's encoder runs."""
    import copy

    models, task = exact("transformer")
    model = copy.deepcopy(models[0])

    class OwnEncoder(type(model.encoder)):
        def forward(self, src_tokens, src_lengths=None, return_all_hiddens=False, token_embeddings=None):
            return super().forward(src_tokens, src_lengths, return_all_hiddens, token_embeddings)

    model.encoder.__class__ = OwnEncoder
    assert lean_encoder.unsupported_reason(model.encoder) == "OwnEncoder has its own forward"
    lean = LeanModel(model, prepack=False)
    assert lean.encoder is None
    batch = task.dataset("test").collater([task.dataset("test")[i] for i in range(4)])
    with torch.no_grad():
        assert_same_keys(lean.encode(batch["net_input"]), LeanModel(models[0], prepack=False).encode(
            batch["net_input"], packed=False), tolerance=0)


@needs_kernels
def test_a_float32_encoder_runs_the_packed_products_on_the_kernel_threads(loaded, kernel_threads):  # noqa: F811
    """With ``prepack`` (the lean runner's default) the float32 encoder's products are the decoder's packed
    ones, so our kernel threads share them: two threads give one thread's bits, and the states equal
    ``at::linear``'s on fairseq's weights to float32 rounding."""
    from fairseq_stream.ops import product as P

    skip_without("mkl")  # the toy's weights are small: MKL's packed GEMM on every CPU
    models, task = loaded("transformer")
    packed, plain = LeanModel(models[0]).encoder, LeanModel(models[0], prepack=False).encoder
    assert {p.precision for layer in packed.products for p in layer} == {"float32"}
    assert all(isinstance(p, P.TorchLinear) for layer in plain.products for p in layer)
    dataset = task.dataset("valid")
    sources = dataset.collater([dataset[i] for i in range(24)])["net_input"]["src_tokens"]
    assert int(sources.ne(packed.padding_idx).sum()) > 64  # more than one of the GEMM's row blocks
    runs = {}
    for threads_ in (1, 2):
        kernel_threads(threads_)
        _, shared_before, _ = module.parallel_counters()
        with torch.no_grad():
            runs[threads_] = packed.encode(sources)[0]
        runs[threads_, "shared"] = module.parallel_counters()[1] - shared_before
    with torch.no_grad():
        reference = plain.encode(sources)[0]
    assert torch.equal(runs[1], runs[2])
    assert runs[2, "shared"] > 0 and runs[1, "shared"] == 0
    assert torch.allclose(runs[2], reference, rtol=0, atol=1e-4), (runs[2] - reference).abs().max().item()
