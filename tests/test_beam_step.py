"""The compiled search step (``fairseq_stream.ops.beam_step``) against its torch reference.

``fairseq_select`` and ``stay_select`` must equal the torch code of
:func:`fairseq_stream.search.selection.fairseq_step` and ``stay_step``
exactly on every step of real decoding: the toy models, every search (both
finalization rules, each pruning heuristic), both kinds of candidates
(whole-vocabulary ones and the fused layer's pre-selected ones); and
``reorder_beam_`` the torch moves it replaces.
"""

import math
from dataclasses import fields

import pytest
import torch

from conftest import decode, decoder_options, differences, sorted_batches
from fairseq_stream.decoder import BeamDecoder
from fairseq_stream.ops import beam_step, loader
from fairseq_stream.search import policies, selection
from fairseq_stream.search.pruning import Pruning

pytestmark = pytest.mark.skipif(not beam_step.available(torch.device("cpu")),
                                reason="the CPU extension is not built (python setup.py build_ext --inplace)")


def assert_same_step(a, b):
    for f in fields(a.sel):
        x, y = getattr(a.sel, f.name), getattr(b.sel, f.name)
        assert (x is None and y is None) or (x.dtype == y.dtype and torch.equal(x, y)), f.name
    for f in fields(a):
        if f.name != "sel":
            x, y = getattr(a, f.name), getattr(b, f.name)
            assert x.dtype == y.dtype and torch.equal(x, y), f.name


@pytest.fixture
def checked_steps(monkeypatch):
    """Every search step of the decoder runs both ways and must agree; returns the count of steps checked."""
    count = [0]

    def both(step):
        def run(*args, **kwargs):
            compiled = step(*args, compiled=True, **kwargs)
            reference = step(*args, compiled=False, **kwargs)
            assert_same_step(compiled, reference)
            count[0] += 1
            return compiled

        return run

    monkeypatch.setattr(policies, "fairseq_step", both(selection.fairseq_step))
    monkeypatch.setattr(policies, "stay_step", both(selection.stay_step))
    return count


SEARCHES = {
    "greedy": decoder_options("greedy"),
    "fixed": decoder_options("fixed"),
    "fixed-stay": decoder_options("fixed-stay"),
    "var-batch": decoder_options("var-batch"),
    "var-fairseq": decoder_options("var-fairseq"),
    # Every heuristic at once, under each rule (thresholds that do prune on the toy models).
    "var-all-stay": dict(beam_size=5, finalize="stay", pruning=Pruning(rp=0.05, ap=2.0, rpl=0.1, mc=2)),
    "var-all-fairseq": dict(beam_size=5, finalize="fairseq", pruning=Pruning(rp=0.05, ap=2.0, rpl=0.1, mc=2)),
}


@pytest.mark.parametrize("model", ["transformer", "lstm"])
@pytest.mark.parametrize("output_layer", ["torch", "fused"])
@pytest.mark.parametrize("search", sorted(SEARCHES))
def test_every_step_of_real_decoding_equals_the_reference(loaded, checked_steps, model, output_layer, search):
    models, task = loaded(model)
    # max_len_b 12: some sentences end at their maximum length, others by k finalized hypotheses.
    dec = BeamDecoder(models, task.target_dictionary, output_layer=output_layer, keep_reference=False,
                      max_len_b=12, **SEARCHES[search])
    out = decode(dec, models, sorted_batches(task, 6, 40), None)
    assert len(out) == 37 and checked_steps[0] > 20  # the whole toy test set


def test_the_stay_rule_under_streaming_equals_the_reference(loaded, checked_steps):
    """Cohorts that split and join (a capacity in rows): done lengths and histories travel with them."""
    models, task = loaded("transformer")
    dec = BeamDecoder(models, task.target_dictionary, keep_reference=False, **SEARCHES["var-batch"])
    out = decode(dec, models, sorted_batches(task, 6, 40),
                 dict(pool_size=12, eps=1 / 6, order="shortest", capacity=9))
    assert len(out) == 37 and checked_steps[0] > 20


def test_float64_steps_equal_the_reference(exact, checked_steps):
    models, task = exact("transformer")
    dec = BeamDecoder(models, task.target_dictionary, beam_size=4, finalize="fairseq")
    assert len(decode(dec, models, sorted_batches(task, 5, 20), None)) == 20
    assert checked_steps[0] > 10


@pytest.mark.parametrize("search", ["fixed", "var-batch"])
def test_decoding_with_and_without_the_compiled_ops_gives_the_same_n_best(loaded, monkeypatch, search):
    models, task = loaded("transformer")
    batches = sorted_batches(task, 8, 37)
    make = lambda: BeamDecoder(models, task.target_dictionary, **decoder_options(search))
    compiled = decode(make(), models, batches, None)
    monkeypatch.setitem(loader._EXTENSIONS, "cpu", None)  # as without the extension: the torch code
    assert not beam_step.available(torch.device("cpu"))
    reference = decode(make(), models, batches, None)
    assert differences(reference, compiled, tolerance=0.0) == []


def test_ties_come_out_in_torch_topk_order():
    # Three sentences whose candidates are all equal, partly equal, or -inf
    # but for one: the op ranks them with torch.topk itself.
    k, V = 3, 7
    cand = torch.tensor([[-1.0] * (k * V),
                         [-2.0, -1.0, -1.0, -3.0, -1.0, -math.inf, -1.0] * k,
                         [-math.inf] * (k * V - 1) + [-0.5]])
    args = dict(k=k, vocab=V, eos=2, pruning=Pruning(), step=3,
                done_len=torch.tensor([[4, 0, 0], [0, 0, 0], [2, 3, 0]]),
                best_finished=torch.tensor([-5.0, -math.inf, -0.1]),
                max_lens=torch.tensor([10, 10, 3]), empty=torch.tensor([False, False, True]),
                ids=torch.tensor([7, 8, 9]))
    a = selection.fairseq_step(cand, cand, compiled=True, **args)
    b = selection.fairseq_step(cand, cand, compiled=False, **args)
    assert_same_step(a, b)
    stay = dict(k=k, vocab=V, eos=2, pad=1, pruning=Pruning(mc=1), step=3, done_len=args["done_len"],
                scores=torch.zeros(3 * k, 6), empty=args["empty"], ids=args["ids"])
    assert_same_step(selection.stay_step(cand, cand, compiled=True, **stay),
                     selection.stay_step(cand, cand, compiled=False, **stay))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reorder_moves_the_histories_as_the_torch_code(dtype):
    g = torch.Generator().manual_seed(0)
    rows, width, step = 10, 9, 5
    tokens = torch.randint(0, 100, (rows, width + 2), generator=g)
    scores = torch.randn(rows, width + 1, generator=g, dtype=dtype)
    parent = torch.randint(0, rows, (rows,), generator=g)
    extended = torch.rand(rows, generator=g) > 0.3
    new_token = torch.randint(0, 100, (rows,), generator=g)
    new_score = torch.randn(rows, generator=g, dtype=dtype)
    expected_tokens, expected_scores = tokens.clone(), scores.clone()
    expected_tokens[:, : step + 1] = tokens[:, : step + 1].index_select(0, parent)
    expected_scores[:, :step] = scores[:, :step].index_select(0, parent)
    expected_tokens[:, step + 1] = torch.where(extended, new_token, tokens[:, step + 1])
    expected_scores[:, step] = torch.where(extended, new_score, scores[:, step])
    beam_step.reorder_beam_(tokens, scores, parent, extended, new_token, new_score, step)
    assert torch.equal(tokens, expected_tokens) and torch.equal(scores, expected_scores)


def test_bad_arguments_are_refused_in_one_line():
    cand = torch.zeros(2, 10)
    with pytest.raises(RuntimeError, match="done_len must be"):
        beam_step.fairseq_select(cand, None, None, 5, 2, 2, 0, torch.zeros(2, 3, dtype=torch.long), torch.zeros(2),
                                 torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.bool),
                                 torch.zeros(2, dtype=torch.long), Pruning())
    with pytest.raises(RuntimeError, match="parent row out of range"):
        beam_step.reorder_beam_(torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 3), torch.tensor([0, 5]),
                                torch.ones(2, dtype=torch.bool), torch.zeros(2, dtype=torch.long), torch.zeros(2), 1)
