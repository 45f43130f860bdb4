"""Models without parameters, and generators built directly (not from fairseq-generate's parser).

fairseq's own generator unit tests decode with models that compute fixed
probabilities from no weights at all; our decoder must run them as fairseq's
SequenceGenerator does (issue 32, item 2). ``task.build_generator`` called
with a plain Namespace (or a search built in Python) must name the search in
its refusals, not ``--search None``.
"""

import argparse

import pytest
import torch
from fairseq.dataclass.configs import GenerationConfig
from fairseq.models import FairseqEncoder, FairseqEncoderDecoderModel, FairseqIncrementalDecoder
from fairseq.sequence_generator import SequenceGenerator
from omegaconf import OmegaConf

from conftest import decode, decoder_options, differences, sorted_batches
from fairseq_stream.decoder import BeamDecoder
from fairseq_stream.errors import FairseqStreamError


class SourceSumEncoder(FairseqEncoder):
    """Encodes each source token as its id (a float), in fairseq's transformer layout; no weights."""

    def forward(self, src_tokens, src_lengths=None, **kwargs):
        mask = src_tokens.eq(self.dictionary.pad())
        x = src_tokens.masked_fill(mask, 0).to(torch.float32).t().unsqueeze(-1)  # (T, B, 1)
        return {"encoder_out": [x], "encoder_padding_mask": [mask], "encoder_embedding": [],
                "encoder_states": [], "src_tokens": [], "src_lengths": []}

    def reorder_encoder_out(self, encoder_out, new_order):
        return {
            "encoder_out": [encoder_out["encoder_out"][0].index_select(1, new_order)],
            "encoder_padding_mask": [encoder_out["encoder_padding_mask"][0].index_select(0, new_order)],
            "encoder_embedding": [], "encoder_states": [], "src_tokens": [], "src_lengths": [],
        }


class FixedFunctionDecoder(FairseqIncrementalDecoder):
    """Logits that are a fixed function of the source, the previous token and the position.

    It keeps no incremental state (each call sees the whole prefix), so rows
    can move and join freely; EOS grows likelier with the position, relative
    to the source's length, so sentences end at different steps.
    """

    def forward(self, prev_output_tokens, encoder_out=None, incremental_state=None, **kwargs):
        source = encoder_out["encoder_out"][0]  # (T, B, 1)
        src_sum = source.sum(dim=0)  # (B, 1)
        src_len = (~encoder_out["encoder_padding_mask"][0]).sum(dim=1, keepdim=True).to(torch.float32)
        B, T = prev_output_tokens.shape
        positions = torch.arange(T, dtype=torch.float32).expand(B, T)
        if incremental_state is not None:
            prev_output_tokens, positions = prev_output_tokens[:, -1:], positions[:, -1:]
        vocab = torch.arange(len(self.dictionary), dtype=torch.float32)
        prev = prev_output_tokens.to(torch.float32).unsqueeze(-1)
        pos = positions.unsqueeze(-1)
        logits = 3 * torch.cos(0.37 * vocab * (1 + (src_sum.unsqueeze(1) % 7)) + 0.11 * prev * vocab + 0.5 * pos)
        logits[..., self.dictionary.eos()] += 2.0 * (pos.squeeze(-1) - src_len)
        return logits, {"attn": [None]}


class WeightlessModel(FairseqEncoderDecoderModel):
    """An encoder-decoder model with no ``nn.Parameter`` and no buffer."""


@pytest.fixture(scope="module")
def weightless(loaded):
    """([the weightless model], the toy task): the toy's dictionaries and test set."""
    _, task = loaded("transformer")
    model = WeightlessModel(SourceSumEncoder(task.source_dictionary), FixedFunctionDecoder(task.target_dictionary))
    model.eval()
    assert not list(model.parameters()) and not list(model.buffers())
    return [model], task


def fairseq_reference(models, task, batches, beam):
    """fairseq's SequenceGenerator's n-best lists by sentence id."""
    gen = SequenceGenerator(models, task.target_dictionary, beam_size=beam, max_len_b=30)
    out = {}
    with torch.no_grad():
        for s in batches:
            out.update(zip(s["id"].tolist(), gen.generate(models, s)))
    return out


@pytest.mark.parametrize("search", ["fixed", "greedy"])
@pytest.mark.parametrize("scheduler", [None, dict(pool_size=3, eps=1 / 6)], ids=["batch", "stream"])
def test_a_model_without_parameters_decodes_as_fairseq_does(weightless, search, scheduler):
    models, task = weightless
    batches = sorted_batches(task, 4, limit=12)
    options = decoder_options(search)
    dec = BeamDecoder(models, task.target_dictionary, max_len_b=30, **options)
    assert dec.runner.dtype == torch.float32
    ours = decode(dec, models, batches, scheduler)
    ref = fairseq_reference(models, task, batches, options["beam_size"])
    assert differences(ref, ours, tolerance=1e-5) == []


def namespace(**overrides):
    """fairseq's generation options as a flat Namespace, as legacy callers pass to build_generator."""
    ns = argparse.Namespace(**OmegaConf.to_container(OmegaConf.structured(GenerationConfig())))
    ns.search, ns.generator = None, None
    for key, value in overrides.items():
        setattr(ns, key, value)
    return ns


def test_build_generator_with_a_namespace_decodes_a_weightless_model(weightless):
    models, task = weightless
    batches = sorted_batches(task, 4, limit=8)
    gen = task.build_generator(models, namespace(search="fixed", beam=3, max_len_b=30))
    ref = fairseq_reference(models, task, batches, 3)
    with torch.no_grad():
        ours = {i: h for s in batches for i, h in zip(s["id"].tolist(), gen.generate(models, s))}
    assert differences(ref, ours, tolerance=1e-5) == []


@pytest.mark.parametrize("search", ["fixed", "var", "var-batch", "var-stream", "greedy", "jacobi"])
def test_direct_builds_name_their_search_in_refusals(weightless, search):
    """A Namespace or a config built in Python has no ``_name``: the message still names the search."""
    from fairseq_stream.registry import SEARCH_DATACLASS_REGISTRY, SEARCH_REGISTRY

    models, task = weightless
    with pytest.raises(FairseqStreamError, match=r"^--search {} does not support --sampling".format(search)):
        task.build_generator(models, namespace(search=search, sampling=True))
    gen_cfg = GenerationConfig(beam=5)
    gen_cfg.sampling = True
    with pytest.raises(FairseqStreamError, match=r"^--search {} does not support --sampling".format(search)):
        SEARCH_REGISTRY[search].build(task, models, gen_cfg, SEARCH_DATACLASS_REGISTRY[search](), None, None)


def test_a_namespace_generator_is_the_scheduler_used(weightless):
    """``generator="stream"`` in a Namespace streams (its config carries the name fairseq's parser would set)."""
    models, task = weightless
    gen = task.build_generator(models, namespace(search="fixed", generator="stream", beam=2, max_len_b=30))
    assert type(gen).__name__ != "BeamDecoder", "the Namespace's --generator stream was ignored"
