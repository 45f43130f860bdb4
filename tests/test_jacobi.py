"""Jacobi decoding (``--search jacobi``) against greedy, the reference, on real decoding.

Exactness is tested in float64 (the window call's arithmetic is greedy's in
another order: multi-token GEMMs, a masked attention), where every variant,
draft and block size must give greedy's tokens on the toy sets, with every
output-layer rule in play at every window position (an unk bonus, a
temperature, EOS banned below --min-len and forced at short maximum
lengths). In float32 the toy sets' printed hypotheses must equal greedy's and
fairseq's ``--beam 1``; the Multi30k test set is checked by
``benchmarks/bench_jacobi.py`` as it times.
"""

import json
import random

import pytest
import torch

from conftest import differences, generate_in_process, hypotheses, run_tool, sorted_batches
from fairseq_stream.decoder import BeamDecoder
from fairseq_stream.errors import FairseqStreamError
from fairseq_stream.jacobi.decoder import JacobiDecoder
from fairseq_stream.jacobi.drafts import AcceptanceRates, NgramPool, likely_draft, likely_tree, next_draft

RULES = dict(unk_penalty=-6.0, temperature=0.8, min_len=3, max_len_a=0.5, max_len_b=2)
SETTINGS = [("pj", 3, "pad"), ("pgj", 3, "pad"), ("pgj", 5, "ngram"), ("hgj", 3, "pad"), ("hgj", 3, "ngram"),
            ("hgj", 1, "ngram")]


def greedy_decoder(models, task, **opts):
    return BeamDecoder(models, task.target_dictionary, beam_size=1, runner="lean", output_layer="auto",
                       keep_reference=False, **opts)


def run(dec, models, batches):
    out = {}
    with torch.no_grad():
        for s in batches:
            out.update(zip(s["id"].tolist(), dec.generate(models, s)))
    return out


@pytest.mark.parametrize("rules", [False, True], ids=["plain", "rules"])
@pytest.mark.parametrize("variant,block,draft", SETTINGS)
@pytest.mark.parametrize("name", ["transformer", "ensemble"])
def test_jacobi_gives_greedys_output_float64(exact, name, variant, block, draft, rules):
    models, task = exact(name)
    opts = RULES if rules else {}
    batches = sorted_batches(task, 8, 1000)
    expected = run(greedy_decoder(models, task, **opts), models, batches)
    # A call cost that keeps windows (not greedy's step) at 8 rows, drafting nearly anything.
    dec = JacobiDecoder(greedy_decoder(models, task, **opts), variant, block, draft, call_cost=1000)
    ours = run(dec, models, batches)
    assert differences(expected, ours, tolerance=1e-9) == []
    stats = dec.stats.summary()
    assert stats["greedy_steps"] == sum(len(h[0]["tokens"]) for h in expected.values())
    assert stats["iterations"] <= stats["greedy_steps"]
    assert sum(stats["accepted_histogram"].values()) == stats["iterations"]


def test_property_random_sources_and_blocks_float64(exact):
    """Random token sequences as sources, random batch and block sizes, every variant: greedy's output."""
    models, task = exact("transformer")
    d = task.source_dictionary
    rng = random.Random(0)
    words = list(range(d.nspecial, len(d)))
    for trial in range(8):
        sources = [torch.tensor([rng.choice(words) for _ in range(rng.randint(1, 12))] + [d.eos()])
                   for _ in range(rng.randint(1, 6))]
        dataset = task.build_dataset_for_inference(sources, [s.numel() for s in sources])
        sample = dataset.collater([dataset[i] for i in range(len(sources))])
        variant = rng.choice(["pj", "pgj", "hgj"])
        block, draft = rng.randint(1, 6), rng.choice(["pad", "ngram"])
        horizon = rng.choice([None, 0, 3])  # hgj: greedy steps after this many tokens
        expected = run(greedy_decoder(models, task), models, [sample])
        ours = run(JacobiDecoder(greedy_decoder(models, task), variant, block, draft, horizon), models, [sample])
        assert differences(expected, ours, tolerance=1e-9) == [], (trial, variant, block, draft, horizon)


@pytest.mark.parametrize("compiled_attention", [True, False], ids=["compiled", "torch-attention"])
def test_ngram_windows_sized_by_cost_give_greedys_output_float64(exact, compiled_attention):
    """hgj/ngram runs per-row windows of 1..b positions in one call (rows' widths differ): greedy's output."""
    models, task = exact("ensemble")
    batches = sorted_batches(task, 4, 1000)
    expected = run(greedy_decoder(models, task, **RULES), models, batches)
    stats = []
    for call_cost in (1e-3, 40.0, 1e6):  # no draft pays; drafts sized by their chance; every draft pays
        greedy = greedy_decoder(models, task, **RULES)
        greedy.runner.compiled_attention = compiled_attention
        dec = JacobiDecoder(greedy, "hgj", 4, "ngram", call_cost=call_cost)
        ours = run(dec, models, batches)
        assert differences(expected, ours, tolerance=1e-9) == [], call_cost
        stats.append(dec.stats.summary())
    none, sized, every = stats
    # "expansions" counts window positions, "iterations" rows' iterations.
    assert none["greedy_batches"] == len(batches)  # 4 rows at a cost of 1e-3: greedy's step
    assert none["iterations"] == none["greedy_steps"] and sized["greedy_batches"] == every["greedy_batches"] == 0
    assert sized["iterations"] > every["iterations"] and sized["expansions"] / sized["iterations"] > 1.0
    assert every["expansions"] / every["iterations"] > sized["expansions"] / sized["iterations"]


@pytest.mark.parametrize("compiled_attention", [True, False], ids=["compiled", "torch-attention"])
@pytest.mark.parametrize("name,rules", [("transformer", True), ("ensemble", False), ("ensemble", True)])
def test_trees_of_candidates_give_greedys_output_float64(exact, name, rules, compiled_attention):
    """--jacobi-candidates: windows shaped as trees (masked attention, positions by depth, branches
    accepted off the first chain moved into place in the cache) still give greedy's output.

    A branch off the first chain must be accepted for the last path to run:
    how often one is depends on the toy (it is trained per machine: 2 to 3
    times in the 37 test sentences for this machine's, 5 to 8 for another),
    so where the test set has none the test goes on through the valid set,
    24 sentences at a time (200 more in all), each checked against greedy's
    output too, until one is.
    """
    models, task = exact(name)
    opts = RULES if rules else {}
    reference = greedy_decoder(models, task, **opts)
    greedy = greedy_decoder(models, task, **opts)
    greedy.runner.compiled_attention = compiled_attention
    dec = JacobiDecoder(greedy, "hgj", 4, "ngram", call_cost=1e6, candidates=6)
    valid = sorted_batches(task, 3, 1000, subset="valid")
    greedy_steps = 0
    for part, batches in enumerate([sorted_batches(task, 3, 1000)] + [valid[i:i + 8] for i in range(0, len(valid), 8)]):
        if part and dec.stats.summary()["off_chain"]:
            break
        expected = run(reference, models, batches)
        assert differences(expected, run(dec, models, batches), tolerance=1e-9) == [], part
        greedy_steps += sum(len(h[0]["tokens"]) for h in expected.values())
    s = dec.stats.summary()
    assert s["tree_windows"] > 0 and s["off_chain"] > 0
    assert s["greedy_steps"] == greedy_steps


def test_trees_run_only_where_candidates_are_asked_for(loaded):
    """Whether trees verify more tokens than one chain depends on the model and data (Multi30k: 1.52 against
    1.43 tokens an iteration, docs/BENCHMARKS.md); here: they run, and give the chain's tokens."""
    models, task = loaded("transformer")
    batches = sorted_batches(task, 1, 1000, subset="valid")
    summaries, outputs = [], []
    for candidates in (1, 8):
        dec = JacobiDecoder(greedy_decoder(models, task), "hgj", 5, "ngram", call_cost=1e6, candidates=candidates)
        outputs.append(run(dec, models, batches))
        summaries.append(dec.stats.summary())
    chain, trees = summaries
    assert chain["tree_windows"] == 0 and trees["tree_windows"] > 0 and trees["off_chain"] > 0
    assert {s: h[0]["tokens"].tolist() for s, h in outputs[0].items()} == \
        {s: h[0]["tokens"].tolist() for s, h in outputs[1].items()}



def test_default_block_is_three_alone_and_two_shared_float64(exact):
    """Without --jacobi-block, hgj's window is 3 positions for a lone sentence and 2 when a call is shared."""
    from fairseq_stream.jacobi.decoder import AUTO_BLOCK

    models, task = exact("transformer")
    dec = JacobiDecoder(greedy_decoder(models, task, **RULES), "hgj", None, "ngram", call_cost=1e6)
    assert AUTO_BLOCK == {"alone": 3, "shared": 2}
    assert [dec.width(4, 50, rows) for rows in (1, 2, 8)] == [3, 2, 2]
    assert dec.width(49, 50, 1) == 2  # never past the maximum length
    assert JacobiDecoder(greedy_decoder(models, task), "pgj", None, "ngram").width(1, 50, 1) == 1  # pgj: b = 2
    batches = sorted_batches(task, 4, 1000) + sorted_batches(task, 1, 12, subset="valid")
    expected = {}
    for b in batches:
        expected.update({(len(b["id"]), s): h for s, h in run(greedy_decoder(models, task, **RULES), models, [b]).items()})
    ours = {}
    for b in batches:
        ours.update({(len(b["id"]), s): h for s, h in run(dec, models, [b]).items()})
    assert differences(expected, ours, tolerance=1e-9) == []
    assert max(int(m) for m in dec.stats.summary()["accepted_histogram"]) == 3


def test_candidates_need_ngram_drafts(loaded):
    models, task = loaded("transformer")
    with pytest.raises(FairseqStreamError, match="--jacobi-candidates above 1 needs --jacobi-draft ngram"):
        JacobiDecoder(greedy_decoder(models, task), "hgj", 3, "pad", candidates=4)
    with pytest.raises(FairseqStreamError, match="--jacobi-candidates must be at least 1"):
        JacobiDecoder(greedy_decoder(models, task), "hgj", 3, "ngram", candidates=0)


def test_a_batch_too_full_for_windows_runs_greedys_step(loaded):
    models, task = loaded("transformer")
    batches = sorted_batches(task, 16, 1000, subset="valid")
    expected = run(greedy_decoder(models, task), models, batches)
    # 16 / (16 + 60) >= 0.15 (the CPU's GREEDY_THRESHOLD): greedy's step; 8 / (8 + 60) is below.
    dec = JacobiDecoder(greedy_decoder(models, task), "hgj", 2, "ngram", call_cost=60)
    ours = run(dec, models, batches)
    assert all(torch.equal(expected[s][0]["tokens"], ours[s][0]["tokens"]) for s in expected)
    s = dec.stats.summary()
    full = [b for b in batches if b["id"].numel() >= 10]
    assert s["greedy_batches"] == len(full) < len(batches)  # the last batch (8) runs windows
    assert s["greedy_steps"] == sum(len(h[0]["tokens"]) for h in expected.values())
    assert "decoded by greedy's step" in dec.stats.log_line("jacobi")
    # The pool learnt from them before the small batch ran windows.
    assert dec.pool.table and not dec.unlearned


def test_call_cost_must_be_positive(loaded):
    models, task = loaded("transformer")
    with pytest.raises(FairseqStreamError, match="--jacobi-call-cost must be positive"):
        JacobiDecoder(greedy_decoder(models, task), "hgj", 2, "ngram", call_cost=0)


def test_jacobi_float32_prints_greedys_hypotheses(loaded):
    models, task = loaded("transformer")
    batches = sorted_batches(task, 16, 1000, subset="valid")
    expected = run(greedy_decoder(models, task), models, batches)
    for variant, block, draft in [("hgj", 3, "ngram"), ("pj", 1, "pad")]:
        # A call cost above the batch size: windows, not greedy's step, for batches of 16.
        ours = run(JacobiDecoder(greedy_decoder(models, task), variant, block, draft, call_cost=100), models, batches)
        assert all(torch.equal(expected[s][0]["tokens"], ours[s][0]["tokens"]) for s in expected)
        assert max(abs(float(expected[s][0]["score"]) - float(ours[s][0]["score"])) for s in expected) < 1e-5


def test_command_line_equals_fairseq_beam_1_and_writes_counters(toy, tmp_path, capsys):
    stats_file = tmp_path / "stats.json"
    common = [toy.data_bin, "--path", toy.transformer, "--gen-subset", "valid", "--batch-size", "16", "--cpu"]
    proc = run_tool(["fairseq-generate"] + common + [
        "--user-dir", "fairseq_stream", "--search", "jacobi", "--jacobi-variant", "hgj", "--jacobi-block", "4",
        "--jacobi-draft", "ngram", "--jacobi-call-cost", "100", "--jacobi-candidates", "4", "--stats-file", stats_file])
    ours = hypotheses(proc.stdout)
    # Without --search the plugin leaves fairseq-generate as it is: fairseq's own beam search.
    generate_in_process(common + ["--user-dir", "fairseq_stream", "--beam", "1"])
    reference = hypotheses(capsys.readouterr().out)
    assert len(ours) == 200
    assert {s: t for s, (_, t) in ours.items()} == {s: t for s, (_, t) in reference.items()}
    stats = json.loads(stats_file.read_text())  # written when the process ends
    assert stats["sentences"] == 200
    assert stats["iteration_speedup"] >= 1.0 and stats["accepted_per_iteration"] >= 1.0
    assert set(stats["accepted_histogram"]) <= {"1", "2", "3", "4"} and stats["greedy_batches"] == 0
    assert stats["tree_windows"] > 0
    assert "tokens accepted per iteration" in proc.stderr


def test_lstm_is_a_one_line_error_naming_greedy(loaded):
    models, task = loaded("lstm")
    with pytest.raises(FairseqStreamError) as err:
        JacobiDecoder(BeamDecoder(models, task.target_dictionary, beam_size=1, runner="auto",
                                  keep_reference=False))
    assert "use --search greedy" in str(err.value) and "not a fairseq transformer" in str(err.value)


def test_api_translates_with_jacobi(toy):
    from fairseq_stream.api import Translator

    lines = (toy.raw / "test.src").read_text().splitlines()[:6]
    greedy = Translator([str(toy.transformer)], data=str(toy.data_bin), search="greedy", cpu=True)
    jacobi = Translator([str(toy.transformer)], data=str(toy.data_bin), search="jacobi", cpu=True,
                        jacobi_block=4)
    want = {t.index: t.text for t in greedy.translate(lines)}
    got = {t.index: t.text for t in jacobi.translate(lines)}
    assert got == want and sorted(got) == list(range(6))


def test_ngram_pool_drafts_the_likeliest_token_at_each_position():
    pool = NgramPool(span=2)
    for tokens in ([2, 5, 6, 1, 4, 2], [2, 5, 6, 1, 7, 2], [2, 5, 6, 3, 9, 2], [2, 5, 6, 3, 9, 2], [2, 5, 6, 3, 9, 2],
                   [2, 5, 6, 1, 8, 2]):
        pool.add_output(tokens)
    # After (5, 6): 1 and 3 were each seen first three times; 3's continuation is the likelier (9 three
    # times, against 4, 7 and 8 once each).
    assert pool.draft([5, 6]) == ((3, 9), [3 / 7, 3 / 7])
    pool.add_output([2, 5, 6, 1, 4, 2])  # 1 four times now: first 1, then 4 (twice)
    assert pool.draft([5, 6]) == ((1, 4), [4 / 8, 2 / 8])
    pool.add_output([2, 5, 6, 3, 7, 2])  # 1 and 3 four times, 9 three times after 3: (3, 9)
    assert pool.draft([5, 6]) == ((3, 9), [4 / 9, 3 / 9])


def test_ngram_pool_drafts_the_most_frequent_continuation():
    pool = NgramPool(span=2)
    pool.add_output([2, 5, 6, 7, 2])
    pool.add_output([2, 5, 6, 8, 2])
    pool.add_output([2, 9, 6, 8, 2])
    assert pool.lookup([5, 6]) == (8, 2)  # seen once each: the newest
    assert pool.lookup([9, 6]) == (8, 2)
    assert pool.lookup([1, 6]) == (8, 2)  # unknown pair: the one-token context (8 twice, 7 once)
    assert pool.lookup([4]) == ()
    assert next_draft([11, 12, 13], pool, [5, 6], 4, pad=1) == [8, 2, 13, 1]
    assert next_draft([11], None, [5, 6], 3, pad=1) == [11, 1, 1]


def test_ngram_drafts_only_what_is_likely_enough():
    pool = NgramPool(span=2)
    for tokens in ([2, 5, 6, 7, 2], [2, 5, 6, 7, 2], [2, 5, 6, 8, 2]):
        pool.add_output(tokens)
    # After (5, 6): (7, 2) twice, (8, 2) once, one unseen: 2/4 for both tokens.
    assert pool.draft([5, 6]) == ((7, 2), [0.5, 0.5])
    rates = AcceptanceRates()  # nothing measured yet: the estimates as they are
    assert likely_draft([11, 12, 13], pool, [5, 6], 4, 0.5, rates) == ([7, 2], [(0.5, False), (0.5, False)])
    assert likely_draft([11, 12, 13], pool, [5, 6], 4, 0.6, rates) == ([], [])
    # A guess after the pool's tokens: GUESS_ACCEPTANCE times their chance.
    assert likely_draft([11, 12, 13], pool, [5, 6], 4, 0.03, rates)[0] == [7, 2, 13]
    assert likely_draft([11, 12, 13], pool, [5, 6], 1, 0.03, rates)[0] == [7]
    assert likely_draft([11, 12], None, [4], 3, 0.05, rates)[0] == [11]
    assert likely_draft([11, 12], None, [4], 3, 0.0, rates)[0] == [11, 12]
    # Measured: tokens estimated at 1/2 were right 1 time in 12: no longer worth a position at 0.3.
    for _ in range(6):
        rates.record([(0.5, False), (0.5, False)], 0)
    rates.record([(0.5, False), (0.5, False)], 1)
    assert abs(rates.chance(0.5, False) - (1 + 8 * 0.5) / (14 + 8)) < 1e-12
    assert likely_draft([11, 12, 13], pool, [5, 6], 4, 0.3, rates) == ([], [])
    assert rates.chance(0.5, True) == 0.5  # guesses are measured apart


def test_a_tree_spends_the_blocks_positions_on_the_likeliest_tokens():
    pool = NgramPool(span=2, candidates=3)
    for tokens in ([2, 5, 6, 7, 2], [2, 5, 6, 7, 2], [2, 5, 6, 8, 9, 2], [2, 5, 6, 8, 10, 2]):
        pool.add_output(tokens)
    # After (5, 6), 1 unseen of 5: (7, 2) twice; (8, 9), then (8, 10) once each.
    rates = AcceptanceRates()
    assert pool.candidates([5, 6], 3) == [((7,), 0.4), ((7, 2), 0.4), ((8,), 0.4), ((8, 10), 0.2), ((8, 9), 0.2)]
    # The chain drafts the likeliest token at each position: 7 (2/5, as likely as 8), then 2 (2/5).
    assert pool.draft([5, 6]) == ((7, 2), [0.4, 0.4])
    # Two positions: the likeliest tokens, 7 and 8 (each at 0.4), before the chain's second token.
    assert likely_tree([], pool, [5, 6], 2, 0.1, rates, 3) == ([7, 8], [0, 0], [(0.4, False), (0.4, False)])
    tokens, parents, _ = likely_tree([], pool, [5, 6], 4, 0.1, rates, 3)
    assert (tokens, parents) == ([7, 2, 8, 10], [0, 1, 0, 3])  # the chain first; (8, 9) left out
    tokens, parents, _ = likely_tree([], pool, [5, 6], 4, 0.3, rates, 3)
    assert (tokens, parents) == ([7, 2, 8], [0, 1, 0])  # 0.2 does not pay at 0.3
    # One candidate, or one position that the chain's first token takes: a chain.
    chain, estimates = likely_draft([], pool, [5, 6], 4, 0.1, rates)
    assert likely_tree([], pool, [5, 6], 4, 0.1, rates, 1) == (chain, None, estimates)
    assert likely_tree([], pool, [5, 6], 1, 0.1, rates, 3) == ([7], None, [(0.4, False)])


def test_ngram_pool_candidates_are_the_most_frequent_continuations():
    """candidates() keeps its rankings up to date as outputs are learnt: against ranking the table afresh."""
    rng = random.Random(1)
    pool = NgramPool(span=2, candidates=3)
    for _ in range(60):
        pool.add_output([2] + [rng.randint(4, 9) for _ in range(rng.randint(1, 12))] + [2])
        context = [2] + [rng.randint(4, 9) for _ in range(rng.randint(0, 3))]
        expected, placed = [], set()
        follows = 0
        for order in NgramPool.ORDERS:
            seen = pool.table.get(tuple(context[-order:])) if order <= len(context) else None
            if not seen or follows >= 3:
                continue
            total = sum(seen.values()) + 1
            # Most frequent first, the newest (last inserted) among equals.
            for follow in sorted(reversed(list(seen)), key=lambda f: -seen[f])[:3]:
                if follows >= 3 or follow in placed:
                    continue
                follows += 1
                for i in range(1, len(follow) + 1):
                    if follow[:i] not in placed:
                        placed.add(follow[:i])
                        share = sum(n for f, n in seen.items() if f[:i] == follow[:i]) / total
                        expected.append((follow[:i], share))
        got = pool.candidates(context, 3)
        assert [n for n, _ in got] == [n for n, _ in expected]
        assert [c for _, c in got] == pytest.approx([c for _, c in expected])


def _likeliest_afresh(seen):
    """The draft of a context with continuation counts ``seen`` (oldest sighting first), ranked from scratch."""
    total = sum(seen.values()) + 1
    prefixes = {}
    for follow, n in seen.items():
        for i in range(1, len(follow) + 1):
            prefixes[follow[:i]] = prefixes.get(follow[:i], 0) + n
    # Token by token by how many continuations begin with it, then the newest.
    _, _, follow = max((tuple(prefixes[f[:i]] for i in range(1, len(f) + 1)), age, f) for age, f in enumerate(seen))
    return follow, [prefixes[follow[:i]] / total for i in range(1, len(follow) + 1)]


@pytest.mark.parametrize("span", [1, 2, 4])
def test_ngram_pool_drafts_are_kept_up_to_date_as_outputs_are_learnt(span):
    """draft()'s incremental bests against ranking the context's continuations afresh, on a skewed vocabulary (ties)."""
    rng = random.Random(span)
    pool = NgramPool(span=span)
    for _ in range(150):
        pool.add_output([2] + [rng.choice([4, 4, 4, 5, 5, 6, 7, 8]) for _ in range(rng.randint(1, 10))] + [2])
        context = [2] + [rng.randint(4, 8) for _ in range(rng.randint(0, 3))]
        expected = ((), [])
        for order in NgramPool.ORDERS:
            seen = pool.table.get(tuple(context[-order:])) if order <= len(context) else None
            if seen:
                expected = _likeliest_afresh(seen)
                break
        follow, chances = pool.draft(context)
        assert follow == expected[0]
        assert chances == pytest.approx(expected[1])


@pytest.mark.parametrize("case, says", [
    ("missing input", "cannot read input file {tmp}/nope.txt"),
    ("not utf-8", "input line 2 is not valid UTF-8"),
    ("empty line", "--sentences [1]: empty line(s) of {tmp}/in.txt, nothing to decode"),
    ("out is a file", "--out {tmp}/in.txt is a file, not a directory"),
    ("missing spm", "--sentencepiece-model {tmp}/nope.model: no such file"),
    ("block 0", "--block must be at least 1, got 0"),
])
def test_ddgviz_refuses_bad_input_in_one_line(toy, tmp_path, case, says):
    """Each was a traceback (FileNotFoundError, UnicodeDecodeError, KeyError: 0, FileExistsError, OSError), or
    named --jacobi-block, an option ddgviz does not have."""
    from fairseq_stream import ddgviz

    text = tmp_path / "in.txt"
    text.write_bytes(b"s1 s2\n" + (b"s3 \xff\n" if case == "not utf-8" else b"\n" if case == "empty line" else b"s3\n"))
    argv = {"input": str(tmp_path / "nope.txt") if case == "missing input" else str(text),
            "out": str(text) if case == "out is a file" else str(tmp_path / "out"), "block": "0" if case == "block 0"
            else "3"}
    extra = ["--sentencepiece-model", str(tmp_path / "nope.model")] if case == "missing spm" else []
    with pytest.raises(SystemExit) as exit_:
        ddgviz.main(["--path", str(toy.transformer), "--data", str(toy.data_bin), "--input", argv["input"],
                     "--sentences", "1", "--out", argv["out"], "--block", argv["block"], "--cpu"] + extra)
    assert str(exit_.value.code).startswith("fairseq-stream: error: " + says.format(tmp=tmp_path))


def test_ddgviz_on_an_lstm_does_not_advise_a_search_it_has_not(toy, tmp_path):
    """It said "use --search greedy": DDGviz has no --search, and draws Jacobi decoding only."""
    from fairseq_stream import ddgviz

    text = tmp_path / "in.txt"
    text.write_text("s1 s2\n")
    with pytest.raises(SystemExit) as exit_:
        ddgviz.main(["--path", str(toy.lstm), "--data", str(toy.data_bin), "--input", str(text),
                     "--sentences", "0", "--out", str(tmp_path / "out"), "--cpu"])
    assert exit_.value.code == ("fairseq-stream: error: DDGviz draws Jacobi decoding, which runs fairseq "
                                "transformers on the lean runner only (this model: LSTMModel is not a fairseq "
                                "transformer)")


def test_ddgviz_writes_a_picture_and_its_json(toy, tmp_path, capsys):
    from fairseq_stream import ddgviz

    src = toy.raw / "test.src"
    ddgviz.main(["--path", str(toy.transformer), "--data", str(toy.data_bin), "--input", str(src),
                 "--sentences", "0", "4", "--out", str(tmp_path), "--cpu"])
    assert "iterations" in capsys.readouterr().out
    for line in (0, 4):
        graph = json.loads((tmp_path / "{}.json".format(line)).read_text())
        assert (tmp_path / "{}.png".format(line)).stat().st_size > 1000
        n = len(graph["tokens"])
        assert len(graph["first"]) == n and all(len(row) == n for row in graph["holds"])
        assert graph["holds"][-1] == [1] * n  # every position holds its token at the end
        assert all(0 <= i < len(graph["holds"]) for i in graph["first"])
