"""The lean runner against the fairseq runner (the reference) on real decoding.

Exactness is tested in float64, end to end: the models, fairseq's attention
softmax and output log-softmax (fairseq takes both in float32 whatever the
model's type; ``float64_fairseq`` lifts that for these tests) and the search's
scores. Every search's n-best lists must then be identical in tokens and
equal in scores and positional scores to 1e-9 (seen: below 1e-13), under
every scheduler, for the toy transformer, a two-model ensemble, a model of
the WMT'19 big architecture and a pre-norm model with learned positions (both
with random weights). In float32 the test set's printed hypotheses are
compared on the toy models; whole-test-set float32 numbers on the Multi30k
model are in ``benchmarks/bench_step.py``.
"""

import argparse
import re

import pytest
import torch

from conftest import decode, decoder_options, differences, sorted_batches
from fairseq_stream.decoder import BeamDecoder
from fairseq_stream.runners import build_runner
from fairseq_stream.runners.lean import LeanRunner, unsupported_reason

SEARCHES = ("greedy", "fixed", "fixed-stay", "var-batch")
SCHEDULERS = {
    "batch": None,
    "stream": dict(pool_size=8, eps=1 / 6, order="shortest"),
    "fifo": dict(pool_size=8, eps=1 / 6, order="fifo"),
}


def random_transformer(task, arch, **overrides):
    """A fairseq transformer of architecture ``arch`` for the toy task, random weights (seed 0)."""
    from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY

    args = argparse.Namespace(arch=arch, share_all_embeddings=True, dropout=0.0, **overrides)
    ARCH_CONFIG_REGISTRY[arch](args)
    torch.manual_seed(0)
    return ARCH_MODEL_REGISTRY[arch].build_model(args, task).eval()


@pytest.fixture(scope="module")
def models64(exact):
    """name -> (float64 models, task): real toy checkpoints and random models of other architectures."""
    cache = {}

    def load(name):
        if name not in cache:
            if name in ("transformer", "ensemble"):
                cache[name] = exact(name)
            else:
                _, task = exact("transformer")
                if name == "wmt19-big":
                    # The WMT'19 De-En/Ru-En models: transformer_wmt_en_de_big
                    # (post-norm, 1024 dims, 16 heads, 6+6 layers) with FFN 8192.
                    model = random_transformer(task, "transformer_wmt_en_de_big",
                                               encoder_ffn_embed_dim=8192, decoder_ffn_embed_dim=8192)
                else:  # pre-norm, learned positions, embedding layer norm, no embedding scale
                    model = random_transformer(
                        task, "transformer", encoder_embed_dim=64, decoder_embed_dim=64,
                        encoder_ffn_embed_dim=128, decoder_ffn_embed_dim=128, encoder_layers=2,
                        decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                        encoder_normalize_before=True, decoder_normalize_before=True,
                        decoder_learned_pos=True, encoder_learned_pos=True, layernorm_embedding=True,
                        no_scale_embedding=True, activation_fn="gelu")
                cache[name] = ([model.double()], task)
        return cache[name]

    return load


# Sentences and length limits per model: the random big model is slow and
# never emits EOS by itself, so it gets a few sentences and short outputs.
SETTINGS = {
    "transformer": dict(limit=40, batch=8, max_len_b=200),
    "ensemble": dict(limit=40, batch=8, max_len_b=200),
    "prenorm-learned": dict(limit=16, batch=8, max_len_b=12),
    "wmt19-big": dict(limit=3, batch=3, max_len_b=6),
}
_references = {}


@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
@pytest.mark.parametrize("search", SEARCHES)
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_lean_nbest_equals_fairseq_runner_float64(models64, float64_fairseq, name, search, scheduler):
    if name == "wmt19-big" and scheduler != "batch":
        pytest.skip("the big model runs under batch only (its streaming paths are the toy models')")
    models, task = models64(name)
    settings = SETTINGS[name]
    batches = sorted_batches(task, settings["batch"], settings["limit"])
    opts = dict(decoder_options(search), max_len_a=0, max_len_b=settings["max_len_b"])
    key = (name, search)
    if key not in _references:
        _references[key] = decode(BeamDecoder(models, task.target_dictionary, runner="fairseq", **opts),
                                  models, batches, None)
    dec = BeamDecoder(models, task.target_dictionary, runner="lean", **opts)
    assert isinstance(dec.runner, LeanRunner)
    ours = decode(dec, models, batches, SCHEDULERS[scheduler])
    assert len(ours) == min(settings["limit"], len(task.dataset("test")))
    assert differences(_references[key], ours) == []


@pytest.mark.parametrize("gemm", ["auto", "onednn"])
def test_lean_float32_prints_the_same_hypotheses(loaded, monkeypatch, caplog, gemm):
    """float32, as users run it: the best hypothesis of every toy test sentence, both models, var-stream; and with
    every product above the skinny rows on oneDNN's GEMM (an AMD CPU's for large weights), said in the log."""
    from fairseq_stream.ops import product

    if gemm == "onednn" and product.onednn_missing_reason():
        pytest.skip(product.onednn_missing_reason())
    monkeypatch.setenv(product.GEMM_VARIABLE, gemm)
    models, task = loaded("ensemble")
    batches = sorted_batches(task, 8, 1000)
    opts = decoder_options("var-batch")
    ref = decode(BeamDecoder(models, task.target_dictionary, runner="fairseq", **opts), models, batches, None)
    with caplog.at_level("INFO"):
        lean = BeamDecoder(models, task.target_dictionary, runner="lean", **opts)
    ours = decode(lean, models, batches, SCHEDULERS["stream"])
    assert {s: ref[s][0]["tokens"].tolist() for s in ref} == {s: ours[s][0]["tokens"].tolist() for s in ours}
    if gemm == "onednn":
        assert lean.runner.lean[0].output.kernel == "onednn"
        assert any(re.search(r"oneDNN's float32 GEMM for (\d+) of \1 decoder products", r.getMessage())
                   for r in caplog.records)


def test_auto_picks_lean_for_transformers_and_keeps_fairseq_where_promised(loaded, caplog):
    from fairseq_stream.runners.fairseq_runner import ModelRunner

    transformers, _ = loaded("ensemble")
    lstm, _ = loaded("lstm")
    assert isinstance(build_runner("auto", transformers), LeanRunner)
    # --search fixed --finalize fairseq promises fairseq's bits: auto keeps the fairseq runner ...
    assert isinstance(build_runner("auto", transformers, keep_fairseq=True), ModelRunner)
    # ... unless lean is asked for.
    assert isinstance(build_runner("lean", transformers, keep_fairseq=True), LeanRunner)
    # An architecture the lean runner does not know: the fairseq runner, said in one log line.
    with caplog.at_level("INFO"):
        assert isinstance(build_runner("lean", lstm), ModelRunner)
    assert unsupported_reason(lstm[0]) == "LSTMModel is not a fairseq transformer"
    assert any("LSTMModel is not a fairseq transformer; using the fairseq runner" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("compiled_attention", [True, False], ids=["compiled-attention", "torch-attention"])
@pytest.mark.parametrize("tight", [False, True])
def test_cohort_split_and_join_keep_lean_state_consistent(exact, float64_fairseq, monkeypatch, tight,
                                                          compiled_attention):
    """A pool that splits cohorts to respect a capacity and joins them again: same n-best as batch.

    ``tight`` makes every state-management path run: every join merges
    caches and encoder keys of different source lengths into one segment,
    caches start at 2 positions (they double as prefixes grow) and are
    compacted as soon as half their slots are free. Both attentions run: the
    compiled one (the CPU's) and the torch reference (what CUDA runs), whose
    packing by sentence the splits and joins must keep right too.
    """
    if tight:
        force_state_paths(monkeypatch, "MAX_SEGMENTS")
    models, batches, ref, dec = var_batch_against_fairseq(exact, 8, compiled_attention)
    ours = decode(dec, models, batches, dict(pool_size=16, eps=1 / 6, order="shortest", capacity=7))
    assert differences(ref, ours) == []


def force_state_paths(monkeypatch, merge_limit: str):
    """Make every lean state path run: segments merge above 1 (``merge_limit``), 2-position caches, compaction."""
    from fairseq_stream.runners import lean

    monkeypatch.setattr(lean, merge_limit, 1)
    monkeypatch.setattr(lean, "INITIAL_CAPACITY", 2)
    monkeypatch.setattr(lean, "COMPACT_ABOVE_SLOTS", 1)


def var_batch_against_fairseq(exact, batch_size, compiled_attention):
    """(models, batches, the fairseq runner's batch n-best, a lean var-batch decoder) on the toy transformer."""
    models, task = exact("transformer")
    batches = sorted_batches(task, batch_size, 40)
    opts = decoder_options("var-batch")
    ref = decode(BeamDecoder(models, task.target_dictionary, runner="fairseq", **opts), models, batches, None)
    dec = BeamDecoder(models, task.target_dictionary, runner="lean", **opts)
    dec.runner.compiled_attention = compiled_attention
    return models, batches, ref, dec


@pytest.mark.parametrize("compiled_attention", [True, False], ids=["compiled-attention", "torch-attention"])
def test_joined_lengths_keep_lean_state_consistent(exact, float64_fairseq, monkeypatch, compiled_attention):
    """Top-up's joins across steps with every state path forced: same n-best as the fairseq runner's batch.

    Every join of states at different lengths merges the neighbouring
    segments at one length (``MAX_MIXED_SEGMENTS`` 1), caches start at 2
    positions and are compacted as soon as half their slots are free.

    Input batches of 2 sentences make the merge happen by the setup, not by
    where the toy's translations end: a refill of the pool of 8 at 4 live
    sentences or fewer admits 2 batches or more, whose segments (at one
    length) meet in the join with the sentences still decoding. With batches
    of 4 a refill took 2 only where it found 3 live or fewer: one join of 9
    merged on this machine's toy, which another CPU's toy need not repeat.
    Now 8 of 16 joins merge (the same on a toy trained under
    ATEN_CPU_CAPABILITY=avx2); none would only if every refill found the
    pool empty (it then joins nothing across lengths).
    """
    force_state_paths(monkeypatch, "MAX_MIXED_SEGMENTS")
    models, batches, ref, dec = var_batch_against_fairseq(exact, 2, compiled_attention)
    merged = []
    merge = dec.runner._merge_equal_lengths

    def counting(segments):
        result = merge(segments)
        merged.append(len(result) < len(segments))
        return result

    dec.runner._merge_equal_lengths = counting  # records whether each one merged; the real one runs
    ours = decode(dec, models, batches, dict(pool_size=8, eps=1 / 2, order="fifo"))
    assert differences(ref, ours) == []
    assert any(merged), "no segments at one length were merged in a join across lengths"


@pytest.mark.parametrize("compiled_attention", [True, False], ids=["compiled-attention", "torch-attention"])
@pytest.mark.parametrize("scheduler", ["batch", "fifo"])
def test_batches_in_input_order_encode_in_groups_exactly(exact, float64_fairseq, monkeypatch, scheduler,
                                                         compiled_attention):
    """With fairseq's encoder (the lean encoder off: GPUs, encoders it does not know), batches in input
    order (mini-batching, top-up) encode their sources in groups of similar length: the same n-best as
    the fairseq runner, which encodes each batch whole."""
    from fairseq_stream.runners import lean_model

    models, task = exact("ensemble")
    dataset = task.dataset("valid")
    batches = [dataset.collater([dataset[i] for i in range(j, j + 16)]) for j in range(0, 96, 16)]
    opts = decoder_options("var-batch")
    ref = decode(BeamDecoder(models, task.target_dictionary, runner="fairseq", **opts), models, batches, None)
    groups = []
    monkeypatch.setattr(lean_model, "ENCODER_CALL_COST", 4)
    real = lean_model.source_groups
    monkeypatch.setattr(lean_model, "source_groups", lambda *args: groups.append(real(*args)) or groups[-1])
    dec = BeamDecoder(models, task.target_dictionary, runner="lean", **opts)
    dec.runner.compiled_attention = compiled_attention
    dec.runner.packed_encoder = False
    ours = decode(dec, models, batches, None if scheduler == "batch" else dict(pool_size=16, eps=1 / 2, order="fifo"))
    assert differences(ref, ours) == []
    assert groups and all(len(g) > 1 for g in groups)


def test_source_groups_cut_where_padding_costs_more_than_a_call():
    from fairseq_stream.runners.lean_model import source_groups

    assert source_groups([5] * 8, 5) == [list(range(8))]  # nothing to save
    assert source_groups([3, 4, 3, 5], 5, call_cost=32) == [[0, 1, 2, 3]]  # too little to save
    groups = source_groups([30, 3, 29, 4, 31, 3, 3, 30], 31, call_cost=8)
    assert groups == [[1, 5, 6, 3], [2, 0, 7, 4]]  # shortest first, each group sorted
    lengths = [(7 * i) % 41 + 1 for i in range(64)]
    groups = source_groups(lengths, 41, call_cost=16)
    assert sorted(i for g in groups for i in g) == list(range(64))
    cost = sum(len(g) * max(lengths[i] for i in g) + 16 for g in groups)
    assert cost < 64 * 41 + 16 and len(groups) > 1


@pytest.mark.parametrize("scheduler", ["batch", "fifo"])
def test_torch_attention_nbest_equals_fairseq_runner_float64(models64, float64_fairseq, scheduler):
    """The attentions' torch references (CUDA's path) in real decoding: an ensemble, fixed-width beams."""
    models, task = models64("ensemble")
    batches = sorted_batches(task, 8, 24)
    opts = dict(decoder_options("fixed-stay"), max_len_a=0, max_len_b=200)
    ref = decode(BeamDecoder(models, task.target_dictionary, runner="fairseq", **opts), models, batches, None)
    dec = BeamDecoder(models, task.target_dictionary, runner="lean", **opts)
    dec.runner.compiled_attention = False
    assert differences(ref, decode(dec, models, batches, SCHEDULERS[scheduler])) == []
