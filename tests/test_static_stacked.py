"""An ensemble stacked on the static-slot runner (runners/static_stacked.py) against the lean runner member by member.

In float64 on the toy checkpoints, a 2-member and a 4-member ensemble
(``transformer`` .. ``transformer4``): the n-best lists of every search under
every scheduler equal the lean runner's member-by-member lists (tokens
identical, scores within 1e-12) at k=5 and at k=50; the torch attention with
rows and lengths padded to buckets (CUDA's path, what a graph would run) too.
The stacked pool holds one cache whatever the members; members of another
shape run one after another, said in one log line. The stacked step
passes the graph checks of tests/test_static_graph_trace.py, with as many
ATen calls per step for 4 members as for 2.
"""

import pytest
import torch

from test_stacked import ENSEMBLES, SCHEDULERS, SEARCHES
from test_static_graph_trace import checked_counts, decode_traced
from test_static_slots import compare
from fairseq_stream.runners import build_runner
from fairseq_stream.runners.static_slots import StaticSlotRunner


@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
@pytest.mark.parametrize("search", SEARCHES)
@pytest.mark.parametrize("name", ENSEMBLES)
def test_static_stacked_nbest_equals_lean_member_by_member_float64(exact, name, search, scheduler):
    compare(exact, name, search, scheduler, stack=True)


@pytest.mark.parametrize("name,search,scheduler", [("ensemble4", "var-batch", "topup"), ("ensemble", "fixed", "batch")])
def test_static_stacked_at_k50_float64(exact, name, search, scheduler):
    compare(exact, name, search, scheduler, k=50, sentences=4, stack=True)


@pytest.mark.parametrize("scheduler", ["batch", "topup"])
@pytest.mark.parametrize("search", ["fixed", "var-batch"])
def test_static_stacked_on_torch_attention_padded_to_buckets_float64(exact, search, scheduler):
    """CUDA's path on the CPU: the members folded into the heads of the torch attentions, rows in buckets."""
    compare(exact, "ensemble4", search, scheduler, stack=True, compiled_attention=False,
            row_buckets=(8, 16, 32, 64), length_bucket=16)


def test_one_stacked_pool_and_the_fallback(exact, caplog, monkeypatch):
    """Stacked: one cache of every member's heads, one slot per row for all members. A member of another shape:
    one after another, said in one log line, as on the lean runner."""
    from fairseq_stream import runners
    from test_lean_runner import random_transformer

    monkeypatch.setattr(runners, "_said", set())
    models, task = exact("ensemble4")
    runner = build_runner("static", models, stack_members=True)
    assert runner.stacked is not None and len(runner.pool.caches) == 1 and runner.pool.caches[0].size(2) == 4 * 4
    # auto: one after another on the CPU's compiled attention (measured no faster stacked), stacked on the torch
    # attention (CUDA's path).
    assert build_runner("static", models).unstacked_reason.startswith("auto: ")
    assert StaticSlotRunner(models, compiled_attention=False).stacked is not None
    other = random_transformer(task, "transformer", encoder_embed_dim=64, decoder_embed_dim=64,
                               encoder_ffn_embed_dim=256, decoder_ffn_embed_dim=256, encoder_layers=2,
                               decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4).double()
    with caplog.at_level("INFO"):
        runner = build_runner("static", [models[0], other], stack_members=True)
    assert runner.stacked is None and len(runner.pool.caches) == 2
    assert any("static-slot runner (2 models, one after another: model 2 has another shape than model 1)"
               in r.getMessage() for r in caplog.records)


# Each case is five traced decodes; fixed's (batch and top-up) stay in the default suite, greedy's and
# var-batch's trace the same stacked step and are slow.
@pytest.mark.parametrize("stream", [False, True], ids=["batch", "topup"])
@pytest.mark.parametrize("search", [
    "fixed", pytest.param("var-batch", marks=pytest.mark.slow), pytest.param("greedy", marks=pytest.mark.slow)])
def test_stacked_steps_trace_as_one_model(exact, search, stream):
    """What a CUDA graph needs, as for one model; stacked, the step's ATen calls do not grow with the members."""
    runs = (("transformer", None), ("ensemble", False), ("ensemble4", False), ("ensemble", True),
            ("ensemble4", True))
    counts = {run: checked_counts(decode_traced(exact, run[0], search, stream, run[1])) for run in runs}
    assert counts["ensemble", True] == counts["ensemble4", True]
    print("{} {}: ATen calls per step: {}".format(search, "topup" if stream else "batch", "; ".join(
        "{} {}: {}".format(name, {None: "", False: "member by member", True: "stacked"}[stack], c)
        for (name, stack), c in counts.items())))


def test_runner_static_with_stack_members_in_the_python_api(toy):
    """``runner="static"`` with ``stack_members`` on and off: the same translations (float32, 2 members)."""
    from fairseq_stream.api import Translator

    lines = [l for l in (toy.raw / "test.src").read_text().splitlines()[:6] if l]
    paths = [str(toy.transformer), str(toy.transformer2)]
    texts = {}
    for value in ("on", "off"):
        translator = Translator(paths, data=str(toy.data_bin), search="var-stream", beam=5, cpu=True,
                                runner="static", stack_members=value)
        assert (translator.decoder.runner.stacked is not None) == (value == "on")
        texts[value] = [t.text for t in translator.translate(lines)]
    assert texts["on"] == texts["off"] and len(texts["on"]) == len(lines) and all(texts["on"])
