"""The static-slot runner (runners/static_slots.py, issue 53 stage 2) against today's lean runner.

In float64 on the toy checkpoints (the transformer and a 2-member ensemble):
a step's log-probabilities within 1e-12 of the lean runner's through starts,
steps and reorders, and the n-best lists of every search under every
scheduler identical (tokens equal, scores within 1e-12), at k=5 and (marked
slow where long) k=50; the torch attention with rows and lengths padded to
buckets (what a CUDA graph would run) too. The runner's step and reorder in
a quiet step read nothing back from the device.
"""

import pytest
import torch

from conftest import decode, decoder_options, differences, sorted_batches
from fairseq_stream.decoder import BeamDecoder
from fairseq_stream.host_sync import count_update_syncs
from fairseq_stream.runners import build_runner
from fairseq_stream.runners.buckets import bucket, parse_buckets
from fairseq_stream.runners.static_slots import StaticSlotRunner
# The stacked runner's tests run the same searches under the same schedulers (top-up: cohorts of different
# lengths join, rows at their own lengths in one call).
from test_stacked import SCHEDULERS, SEARCHES

TOLERANCE = 1e-12


def decoders(models, task, search, k=None, stack=None, **static_options):
    """(lean decoder, static-slot decoder) of ``search`` (beam ``k`` where given); ``static_options`` set on the
    static-slot runner. ``stack`` (True or False): the static-slot runner's ``stack_members``, against the lean
    runner member by member."""
    def options():
        opts = dict(decoder_options(search), output_layer="torch" if search == "fixed" else "fused")
        if k is not None and search != "greedy":
            opts["beam_size"] = k
        return opts

    lean_stack, static_stack = (None, None) if stack is None else (False, stack)
    lean = BeamDecoder(models, task.target_dictionary, runner="lean", keep_reference=False,
                       stack_members=lean_stack, **options())
    static = BeamDecoder(models, task.target_dictionary, runner="static", keep_reference=False,
                         stack_members=static_stack, **options())
    assert isinstance(static.runner, StaticSlotRunner)
    assert stack is None or (lean.runner.stacked is None and (static.runner.stacked is not None) == stack)
    for name, value in static_options.items():
        setattr(static.runner, name, value)
    return lean, static


def compare(exact, name, search, scheduler, k=None, sentences=12, size=4, **static_options):
    models, task = exact(name)
    batches = sorted_batches(task, size, sentences)
    lean, static = decoders(models, task, search, k, **static_options)
    ref = decode(lean, models, batches, SCHEDULERS[scheduler])
    ours = decode(static, models, batches, SCHEDULERS[scheduler])
    assert len(ours) == sentences
    assert differences(ref, ours, tolerance=TOLERANCE) == []


@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
@pytest.mark.parametrize("search", SEARCHES)
@pytest.mark.parametrize("name", ["transformer", "ensemble"])
def test_static_nbest_equals_lean_float64(exact, name, search, scheduler):
    compare(exact, name, search, scheduler)


@pytest.mark.parametrize("scheduler", ["batch", "topup"])
@pytest.mark.parametrize("search", ["fixed", "var-batch"])
def test_static_nbest_equals_lean_at_k50_float64(exact, search, scheduler):
    compare(exact, "transformer", search, scheduler, k=50, sentences=4)


@pytest.mark.slow
@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
@pytest.mark.parametrize("search", [s for s in SEARCHES if s != "greedy"])
@pytest.mark.parametrize("name", ["transformer", "ensemble"])
def test_static_nbest_equals_lean_at_k50_everywhere_float64(exact, name, search, scheduler):
    compare(exact, name, search, scheduler, k=50, sentences=8)


@pytest.mark.parametrize("scheduler", ["batch", "stream", "topup"])
@pytest.mark.parametrize("search", ["fixed", "var-batch"])
def test_torch_attention_padded_to_buckets_equals_lean_float64(exact, search, scheduler):
    """CUDA's path on the CPU, as a graph would run it: rows padded to a bucket (pad slot), keys to 16s."""
    compare(exact, "ensemble", search, scheduler, compiled_attention=False, row_buckets=(8, 16, 32, 64),
            length_bucket=16)


def test_a_steps_log_probabilities_within_1e12_of_lean_float64(exact):
    """Start, then steps and reorders (beams copied across slots, a sentence dropped) with the same inputs."""
    models, task = exact("ensemble")
    sample = sorted_batches(task, 6, 1000)[0]
    lean, static = (build_runner(kind, models, keep_fairseq=False) for kind in ("lean", "static"))
    k, S = 4, sample["id"].numel()
    states = [r.start(sample["net_input"], k) for r in (lean, static)]
    tokens = torch.full((S * k, 1), task.target_dictionary.eos(), dtype=torch.long)
    generator = torch.Generator().manual_seed(0)
    for step in range(6):
        outs = [r.step(s, tokens)[0] for r, s in zip((lean, static), states)]
        assert (outs[0] - outs[1]).abs().max().item() <= TOLERANCE
        rows = tokens.size(0) // k
        keep = rows if step != 3 else rows - 1  # the last sentence ends at step 3
        parents = torch.randint(0, k, (keep, k), generator=generator) + torch.arange(keep).unsqueeze(1) * k
        order = parents.sort(dim=1).values.view(-1)
        counts = [k] * keep + [0] * (rows - keep)
        lean.reorder(states[0], order)
        static.reorder(states[1], order, sentence_rows=counts)
        tokens = torch.cat([tokens[order], outs[0][order].argmax(dim=1, keepdim=True)], dim=1)


@pytest.mark.parametrize("search", ["fixed", "var-batch"])
def test_quiet_steps_read_nothing_in_the_runner(loaded, search):
    models, task = loaded("transformer")
    dec = BeamDecoder(models, task.target_dictionary, runner="static", keep_reference=False,
                      **decoder_options(search))
    with torch.no_grad(), count_update_syncs(dec) as records:
        for s in sorted_batches(task, 8, 24):
            dec.generate(models, s)
    quiet = [r for r in records if r.quiet]
    assert quiet and all(r.runner_syncs == 0 for r in quiet), [r.runner_events for r in quiet if r.runner_syncs][:2]


def test_slots_are_given_back_and_reused(exact):
    """Decoding batch after batch reuses the pool's slots: it does not grow past the first batches' needs."""
    models, task = exact("transformer")
    lean, static = decoders(models, task, "var-batch")
    batches = sorted_batches(task, 4, 1000)
    decode(static, models, batches[:2], None)
    pool = static.runner.pool
    sizes = (pool.slots.capacity, pool.sentences.capacity)
    decode(static, models, batches[2:8], None)
    assert (pool.slots.capacity, pool.sentences.capacity) == sizes
    assert len(pool.slots.free) == pool.slots.capacity - 1 and len(pool.sentences.free) == pool.sentences.capacity - 1


@pytest.mark.parametrize("scheduler", ["stream", "fifo", "topup"])
# --host-lag runs the dense searches only; a variable-width search's rows per sentence are at most its beam too.
@pytest.mark.parametrize("search,lag", [("greedy", 0), ("greedy", 2), ("fixed", 0), ("fixed", 2), ("var-batch", 0)])
def test_a_stream_decode_sizes_its_pool_once(loaded, search, scheduler, lag):
    """The pool is sized at the decode's first batch from what the scheduler holds at once and the input's
    longest source (fairseq-generate's look-ahead sets it from the data set's sizes; issue 53): it never grows
    after (a growth would make a captured step be captured again), whatever joins, splits, refills and late
    reads happen. Without the longest source, the encoder keys grow with the sources (the batches come
    shortest first) and nothing else does."""
    from fairseq_stream.schedule.pool import StreamPool

    models, task = loaded("transformer")
    batches = sorted_batches(task, 6, 40)
    for longest in (max(b["net_input"]["src_tokens"].size(1) for b in batches), None):
        dec = BeamDecoder(models, task.target_dictionary, runner="static", keep_reference=False, host_lag=lag,
                          **decoder_options(search))
        pool = dec.runner.pool
        engine = StreamPool(dec, **SCHEDULERS[scheduler])
        engine.longest_source = longest
        with torch.no_grad():
            out = dict(engine.run(dec.open(b["net_input"], ids=b["id"]) for b in batches))
        assert len(out) == sum(b["id"].numel() for b in batches) > 30
        assert pool.slots.capacity > 8 * dec.beam_size
        if longest is not None:
            assert pool.growths == []
        else:
            assert pool.growths and {what for what, _, _ in pool.growths} == {"source"}, pool.growths


def test_a_reservation_the_device_has_no_room_for_is_cut(loaded, monkeypatch, caplog):
    """Where the device's free memory (CUDA's, here set by hand on the CPU) cannot hold what the scheduler may
    hold, the pool reserves what half of it holds, says so in one line, and grows as the decode needs; the
    output is the uncut pool's, bit for bit."""
    import logging

    from fairseq_stream.runners import slot_pool
    from fairseq_stream.schedule.pool import StreamPool

    assert slot_pool.device_free_bytes(torch.device("cpu")) is None  # the CPU's pools are never cut
    models, task = loaded("transformer")
    batches = sorted_batches(task, 6, 40)
    longest = max(b["net_input"]["src_tokens"].size(1) for b in batches)

    def run():
        dec = BeamDecoder(models, task.target_dictionary, runner="static", keep_reference=False,
                          **decoder_options("fixed"))
        engine = StreamPool(dec, **SCHEDULERS["topup"])
        engine.longest_source = longest
        with torch.no_grad():
            return dict(engine.run(dec.open(b["net_input"], ids=b["id"]) for b in batches)), dec.runner.pool

    full, full_pool = run()
    assert full_pool.reserve_cut is None and full_pool.growths == []
    one_slot = sum(2 * len(m.layers) * m.heads * m.head_dim * 4 for m in full_pool.models) * full_pool.positions
    room = 2 * one_slot * (slot_pool.FIRST_SLOTS + 8)  # half of it: a little more than the first slots
    monkeypatch.setattr(slot_pool, "device_free_bytes", lambda device: room)
    with caplog.at_level(logging.INFO, logger=slot_pool.__name__):
        cut, cut_pool = run()
    wanted, budget = cut_pool.reserve_cut
    assert budget == room // 2 < wanted
    assert [r.getMessage() for r in caplog.records if "slot pool reserves" in r.getMessage()]
    assert cut_pool.growths and full_pool.slots.capacity > slot_pool.FIRST_SLOTS
    assert differences(full, cut, tolerance=0.0) == []


def test_fairseq_generate_knows_the_longest_source(loaded):
    """The look-ahead's batches carry the generation subset's longest source, which the pool is sized for."""
    from types import SimpleNamespace

    from fairseq_stream.schedule.stream import fairseq_generate_batches

    models, task = loaded("transformer")
    build = fairseq_generate_batches(task, models, SimpleNamespace(dataset=SimpleNamespace(gen_subset="test")))
    widths = [b["net_input"]["src_tokens"].size(1) for b in sorted_batches(task, 8, 10 ** 6)]
    assert build.longest_source == max(widths)


def test_buckets():
    assert [bucket(n, (8, 16, 32)) for n in (1, 8, 9, 32, 33, 65)] == [8, 8, 16, 32, 64, 96]


def test_runner_static_on_the_command_line_decodes_as_lean(toy, capsys):
    """``--runner static`` in fairseq-generate (float32): every sentence out once, the lean runner's output."""
    from conftest import generate_in_process, hypotheses

    out = {}
    for runner in ("lean", "static"):
        generate_in_process([toy.data_bin, "--path", toy.transformer, "--gen-subset", "test", "--batch-size", "8",
                             "--beam", "5", "--cpu", "--user-dir", "fairseq_stream", "--search", "var-stream",
                             "--runner", runner])
        out[runner] = hypotheses(capsys.readouterr().out)
    assert sorted(out["static"]) == list(range(37))
    # float32: the same words; scores as printed, within float32's rounding of another summation order
    assert {i: text for i, (_, text) in out["static"].items()} == {i: text for i, (_, text) in out["lean"].items()}
    assert all(abs(float(out["static"][i][0]) - float(out["lean"][i][0])) <= 1e-3 for i in out["lean"])


def test_the_python_api_takes_the_static_runner(toy):
    from fairseq_stream.api import Translator

    lines = [l for l in (toy.raw / "test.src").read_text().splitlines()[:6] if l]
    texts = {}
    for runner in ("lean", "static"):
        translator = Translator([str(toy.transformer)], data=str(toy.data_bin), search="var-stream", beam=5,
                                cpu=True, runner=runner)
        texts[runner] = [t.text for t in translator.translate(lines)]
    assert texts["static"] == texts["lean"] and len(texts["static"]) == len(lines)


def test_static_buckets_option(toy, capsys, monkeypatch):
    """``--static-buckets`` reaches the runner and decodes as without it; a bad one is a one-line error."""
    from conftest import generate_in_process, hypotheses, parse_generate_args
    from fairseq_stream import build

    assert parse_buckets("8,16,32:16") == ([8, 16, 32], 16) and parse_buckets(":16") == (None, 16)
    runners = []
    build_decoder = build.build_decoder

    def recording(*args, **kwargs):
        decoder = build_decoder(*args, **kwargs)
        runners.append(decoder.runner)
        return decoder

    monkeypatch.setattr(build, "build_decoder", recording)
    argv = [toy.data_bin, "--path", toy.transformer, "--gen-subset", "test", "--batch-size", "8", "--beam", "5",
            "--cpu", "--user-dir", "fairseq_stream", "--search", "var-stream", "--runner", "static"]
    out = {}
    for extra in ([], ["--static-buckets", "8,16,32,64:16"]):
        generate_in_process(argv + extra)
        out[bool(extra)] = {i: text for i, (_, text) in hypotheses(capsys.readouterr().out).items()}
    assert out[True] == out[False] and len(out[True]) == 37
    assert (runners[0].row_buckets, runners[-1].row_buckets, runners[-1].length_bucket) == (None, [8, 16, 32, 64], 16)
    for bad, message in ((["--static-buckets", "8,x"], "ROWS[,ROWS...]"), (["--runner", "lean", "--static-buckets",
                                                                             ":16"], "is for --runner static")):
        with pytest.raises(SystemExit):
            parse_generate_args(argv + bad)
        assert message in capsys.readouterr().err


def test_jacobi_names_the_static_runner_when_it_refuses(loaded):
    """Jacobi's windows run on the lean runner only; the one-line refusal names the runner asked for."""
    from fairseq_stream.errors import FairseqStreamError
    from fairseq_stream.jacobi.decoder import JacobiDecoder

    models, task = loaded("transformer")
    greedy = BeamDecoder(models, task.target_dictionary, beam_size=1, runner="static")
    with pytest.raises(FairseqStreamError, match="--runner static was asked for"):
        JacobiDecoder(greedy)
