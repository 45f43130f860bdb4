"""Our decoding loop against fairseq's SequenceGenerator on real toy checkpoints.

Exactness: ``--search fixed --finalize fairseq`` runs the same decoder rows in
the same order as SequenceGenerator, so tokens, scores and positional scores
are compared for bitwise equality (no tolerance); any difference is counted
and reported.
"""

import copy
import json
import math

import pytest
import torch
from fairseq import utils
from fairseq.sequence_generator import SequenceGenerator

from conftest import hypotheses, run_plain_fairseq_generate, run_tool
from fairseq_stream.decoder import BeamDecoder
from fairseq_stream.search.pruning import Pruning


def batches(task, size=8):
    dataset = task.dataset("test")
    return list(task.get_batch_iterator(dataset=dataset, max_sentences=size,
                                        required_batch_size_multiple=1,
                                        disable_iterator_cache=True).next_epoch_itr(shuffle=False))


def decode(generator, models, task, device="cpu"):
    out = {}
    with torch.no_grad():
        for sample in batches(task):
            if device == "cuda":
                sample = utils.move_to_cuda(sample)
            for sid, hyps in zip(sample["id"].tolist(), generator.generate(models, sample)):
                out[sid] = hyps
    return out


def mismatches(ref, ours):
    """Sentences whose n-best lists differ in tokens, score (its device too) or positional scores."""
    bad = []
    for sid in ref:
        a, b = ref[sid], ours[sid]
        same = len(a) == len(b) and all(
            torch.equal(x["tokens"], y["tokens"]) and x["score"].device == y["score"].device
            and torch.equal(x["score"], y["score"])
            and torch.equal(x["positional_scores"], y["positional_scores"])
            for x, y in zip(a, b))
        if not same:
            bad.append(sid)
    return bad


@pytest.mark.parametrize("name", ["transformer", "lstm", "ensemble"])
@pytest.mark.parametrize("beam", [1, 5, 50])
def test_fixed_fairseq_mode_equals_sequence_generator(loaded, name, beam):
    models, task = loaded(name)
    ref = decode(SequenceGenerator(models, task.target_dictionary, beam_size=beam), models, task)
    ours = decode(BeamDecoder(models, task.target_dictionary, beam_size=beam), models, task)
    assert len(ours) == len(ref) == 37
    assert mismatches(ref, ours) == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["transformer", "lstm"])
def test_fixed_fairseq_mode_equals_sequence_generator_on_cuda_as_printed(loaded, name):
    """On CUDA too, and as fairseq-generate prints a score: ``hypo["score"] / math.log(2)`` multiplies by the
    reciprocal on CUDA and divides on the CPU, so the score must live where fairseq's does."""
    cpu_models, task = loaded(name)
    models = [copy.deepcopy(m).cuda() for m in cpu_models]
    ref = decode(SequenceGenerator(models, task.target_dictionary, beam_size=5), models, task, "cuda")
    ours = decode(BeamDecoder(models, task.target_dictionary, beam_size=5), models, task, "cuda")
    assert len(ours) == len(ref) == 37
    assert mismatches(ref, ours) == []
    printed = lambda out: {sid: [float(h["score"] / math.log(2)) for h in hyps] for sid, hyps in out.items()}
    assert printed(ours) == printed(ref)


def test_fairseq_options_are_honoured_identically(loaded):
    models, task = loaded("transformer")
    opts = dict(beam_size=5, len_penalty=0.6, unk_penalty=0.5, min_len=3, max_len_b=12,
                no_repeat_ngram_size=2, temperature=0.8)
    ref = decode(SequenceGenerator(models, task.target_dictionary, **opts), models, task)
    ours = decode(BeamDecoder(models, task.target_dictionary, **opts), models, task)
    assert mismatches(ref, ours) == []


def at_length_limit(task, out, max_len_a, max_len_b, max_positions):
    """Sentences with a hypothesis cut at fairseq's maximum length (batch padded width * a + b)."""
    hit = set()
    for sample in batches(task):
        max_len = min(int(max_len_a * sample["net_input"]["src_tokens"].size(1) + max_len_b), max_positions - 1)
        for sid in sample["id"].tolist():
            if any(h["tokens"].numel() == max_len + 1 for h in out[sid]):
                hit.add(sid)
    return hit


# Limits that bind: many hypotheses are cut at 0.5 x the batch's padded source width + b.
BINDING = [
    dict(max_len_a=0.5, max_len_b=2),
    dict(max_len_a=0.5, max_len_b=3, len_penalty=0.6, unk_penalty=0.3, min_len=2, temperature=0.9,
         no_repeat_ngram_size=2),
]


@pytest.mark.parametrize("name", ["transformer", "lstm", "ensemble"])
@pytest.mark.parametrize("opts", BINDING, ids=["a0.5-b2", "a0.5-b3-options"])
@pytest.mark.parametrize("beam", [1, 5])
def test_fixed_equals_sequence_generator_when_length_limits_bind(loaded, name, opts, beam):
    models, task = loaded(name)
    ref = decode(SequenceGenerator(models, task.target_dictionary, beam_size=beam, **opts), models, task)
    ours = decode(BeamDecoder(models, task.target_dictionary, beam_size=beam, **opts), models, task)
    assert len(ours) == len(ref) == 37
    assert mismatches(ref, ours) == []
    max_positions = min(m.max_decoder_positions() for m in models)
    assert len(at_length_limit(task, ref, opts["max_len_a"], opts["max_len_b"], max_positions)) >= 5


@pytest.mark.parametrize("name", ["transformer", "lstm"])
def test_the_maximum_length_rounds_as_fairseqs_double_arithmetic(loaded, name):
    """fairseq's int(1.16 * 25 + 0) is 28 (28.999999999999996 in double); in float32 it is 29, our cap was 29,
    and every hypothesis that ran to the cap was one token longer than fairseq's."""
    models, task = loaded(name)
    eos = task.target_dictionary.eos()
    words = [t[t.ne(eos)] for t in task.dataset("test")[0]["source"].unsqueeze(0)] * 4
    width = 25  # 24 tokens and EOS: no padding, the batch as wide as each source
    src = torch.stack([torch.cat([w.repeat(width)[:width - 1], torch.tensor([eos])]) for w in words])
    sample = {"id": torch.arange(len(words)), "net_input": {"src_tokens": src,
                                                            "src_lengths": torch.full((len(words),), width)}}
    opts = dict(beam_size=5, max_len_a=1.16, max_len_b=0, unk_penalty=-100)  # <unk> each step: to the cap
    with torch.no_grad():
        ref = dict(enumerate(SequenceGenerator(models, task.target_dictionary, **opts).generate(models, sample)))
        ours = dict(enumerate(BeamDecoder(models, task.target_dictionary, **opts).generate(models, sample)))
    assert int(1.16 * width) == 28 and ref[0][0]["tokens"].numel() == 28 + 1
    assert mismatches(ref, ours) == []


def test_fairseqs_diverse_beam_search_runs_any_batch_as_its_first(loaded):
    """fairseq 0.12's --diverse-beam-groups indexed a batch-sized tensor by sentence ids: fairseq-generate's
    --search beam died with an IndexError at its first batch whose ids passed its size. With the ids as rows
    (0..bsz-1), where fairseq's worked, and with any others, the n-best lists are now the same."""
    from fairseq.search import DiverseBeamSearch

    models, task = loaded("transformer")  # the plugin's import patched fairseq's search (fairseq_glue)
    sample = batches(task)[1]
    generator = SequenceGenerator(models, task.target_dictionary, beam_size=4,
                                  search_strategy=DiverseBeamSearch(task.target_dictionary, 2, 0.5))
    bsz = sample["id"].numel()
    with torch.no_grad():
        as_rows = generator.generate(models, dict(sample, id=torch.arange(bsz)))
        as_ids = generator.generate(models, dict(sample, id=torch.arange(bsz) + 100))
    assert mismatches(dict(enumerate(as_rows)), dict(enumerate(as_ids))) == []


@pytest.mark.parametrize("finalize", ["fairseq", "stay"])
@pytest.mark.parametrize("name", ["transformer", "lstm"])
def test_var_with_no_heuristic_equals_fixed_when_length_limits_bind(loaded, name, finalize):
    models, task = loaded(name)
    opts = dict(beam_size=5, finalize=finalize, max_len_a=0.5, max_len_b=2)
    fixed = decode(BeamDecoder(models, task.target_dictionary, **opts), models, task)
    var = decode(BeamDecoder(models, task.target_dictionary, pruning=Pruning(ap=1e9), **opts), models, task)
    top = lambda out: {sid: h[0]["tokens"].tolist() for sid, h in out.items()}
    assert top(var) == top(fixed)
    assert at_length_limit(task, fixed, 0.5, 2, models[0].max_decoder_positions())


def test_fixed_generate_with_options_is_identical_to_plain_fairseq_generate(toy):
    """fairseq-generate --search fixed with non-default generation options, line by line against plain fairseq."""
    args = [toy.data_bin, "--path", toy.transformer, "--gen-subset", "test", "--batch-size", "8", "--beam", "5",
            "--cpu", "--required-batch-size-multiple", "1", "--lenpen", "0.6", "--unkpen", "0.3", "--min-len", "2",
            "--max-len-a", "0.5", "--max-len-b", "3", "--no-repeat-ngram-size", "2", "--temperature", "0.9",
            "--nbest", "2"]
    plain = run_plain_fairseq_generate(args).stdout
    ours = run_tool(["fairseq-generate"] + args + ["--user-dir", "fairseq_stream", "--search", "fixed"]).stdout
    pick = lambda out: sorted(l for l in out.splitlines() if l[:2] in ("S-", "T-", "H-", "D-", "P-"))
    assert sum(l.startswith("H-") for l in pick(plain)) == 2 * 37
    assert pick(ours) == pick(plain)


@pytest.mark.parametrize("finalize", ["fairseq", "stay"])
@pytest.mark.parametrize("name", ["transformer", "lstm"])
def test_var_with_no_heuristic_equals_fixed(loaded, name, finalize):
    models, task = loaded(name)
    fixed = decode(BeamDecoder(models, task.target_dictionary, beam_size=5, finalize=finalize), models, task)
    # A heuristic that never prunes takes the variable-width (live rows only) path.
    var = decode(BeamDecoder(models, task.target_dictionary, beam_size=5, finalize=finalize,
                             pruning=Pruning(ap=1e9)), models, task)
    top = lambda out: {sid: h[0]["tokens"].tolist() for sid, h in out.items()}
    assert top(var) == top(fixed)


def test_pruning_shrinks_the_work_and_keeps_most_translations(loaded):
    models, task = loaded("transformer")
    full = BeamDecoder(models, task.target_dictionary, beam_size=10, finalize="stay")
    pruned = BeamDecoder(models, task.target_dictionary, beam_size=10, finalize="stay",
                         pruning=Pruning(ap=1.5, mc=5))
    a, b = decode(full, models, task), decode(pruned, models, task)
    assert pruned.stats.expansions < full.stats.expansions
    same = sum(a[s][0]["tokens"].tolist() == b[s][0]["tokens"].tolist() for s in a)
    assert same >= 30  # of 37; pruning is approximate by design


def test_stats_file_and_cli_presets(toy, tmp_path):
    stats = tmp_path / "stats.json"
    proc = run_tool(["fairseq-generate", toy.data_bin, "--path", toy.transformer, "--gen-subset", "test",
                     "--batch-size", "8", "--beam", "5", "--cpu", "--user-dir", "fairseq_stream",
                     "--search", "var-batch", "--stats-file", stats, "--stats-steps"])
    assert len(hypotheses(proc.stdout)) == 37
    data = json.loads(stats.read_text())
    for key in ("sentences", "timesteps", "expansions", "expansions_per_step", "wall_s", "steps"):
        assert key in data
    assert data["sentences"] == 37 and data["timesteps"] == len(data["steps"])
    assert "var-batch: 37 sentences" in proc.stderr
