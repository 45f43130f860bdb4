"""The engine's step (engine.py): the model call, the search policy and the bookkeeping, each through its interface.

Issue 51 asks for one loop that calls the runner's step with the output
layer, the search policy (fairseq's ``Search.step``) and the bookkeeping,
each through a declared interface. These tests decode the toy models and
record, through the decoder's own methods, the order in which the engine
calls the three: one model call a plan, then each cohort's search step and
its bookkeeping, in the plan's order (the decode bitwise the one without
the records); and Jacobi's window steps as the same three parts.
"""

import pytest
import torch

from conftest import decode, decoder_options, differences, sorted_batches
from fairseq_stream.decoder import BeamDecoder
from fairseq_stream.engine import Bookkeeping, CohortDecoder, CohortSteps, SearchPolicy, StepModel


def recording(dec, log):
    """Wrap ``dec``'s three step parts so that each call is logged (name, cohort ids); the real methods run."""
    call_model, select, update = dec.call_model, dec.policy.select, dec.books.update

    def model(cohorts):
        log.append(("model", [id(c) for c in cohorts]))
        return call_model(cohorts)

    def policy(c, found):
        log.append(("select", id(c)))
        return select(c, found)

    def books(c, chosen):
        log.append(("update", id(c)))
        return update(c, chosen)

    dec.call_model, dec.policy.select, dec.books.update = model, policy, books


def plans(log):
    """The log cut at each model call: [(the call's cohorts, the phases that followed it)]."""
    out = []
    for entry in log:
        if entry[0] == "model":
            out.append((entry[1], []))
        else:
            out[-1][1].append(entry)
    return out


def test_the_beam_decoder_assembles_the_three_parts(loaded):
    models, task = loaded("transformer")
    dec = BeamDecoder(models, task.target_dictionary, beam_size=2)
    for interface in (StepModel, SearchPolicy, Bookkeeping, CohortSteps, CohortDecoder):
        assert isinstance(dec, interface), interface.__name__


@pytest.mark.parametrize("search", ["greedy", "fixed", "fixed-stay"])
def test_the_policy_and_bookkeeping_are_objects_of_their_own_that_keep_no_decoder_alive(loaded, search):
    """The engine is handed the decoder's policy and bookkeeping, each with its own interface; neither holds
    the decoder, so a decoder and its runner are freed when the last reference goes (no reference cycle)."""
    import gc
    import weakref

    models, task = loaded("transformer")
    dec = BeamDecoder(models, task.target_dictionary, **decoder_options(search))
    assert dec.policy is not dec and isinstance(dec.policy, SearchPolicy)
    assert dec.books is not dec and isinstance(dec.books, Bookkeeping)
    decode(dec, models, sorted_batches(task, 4, 8, subset="valid"), None)
    decoder, runner = weakref.ref(dec), weakref.ref(dec.runner)
    gc.disable()
    try:
        del dec
        assert decoder() is None and runner() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("search", ["greedy", "fixed", "var-batch"])
def test_each_plan_is_one_model_call_then_each_cohorts_search_step_and_bookkeeping(loaded, search):
    models, task = loaded("transformer")
    batches = sorted_batches(task, 8, 60, subset="valid")
    # FIFO at ε = 1/2: refills join cohorts still decoding, so calls carry cohorts at different lengths.
    pool = dict(pool_size=8, eps=1 / 2, order="fifo")
    expected = decode(BeamDecoder(models, task.target_dictionary, **decoder_options(search)), models, batches, pool)
    dec = BeamDecoder(models, task.target_dictionary, **decoder_options(search))
    log = []
    recording(dec, log)
    ours = decode(dec, models, batches, pool)
    assert differences(expected, ours, tolerance=0.0) == []  # the recorded parts are the decoder's own
    steps = plans(log)
    assert steps and len(steps) == dec.stats.timesteps
    for cohorts, phases in steps:
        assert phases == [p for c in cohorts for p in (("select", c), ("update", c))]
    assert any(len(cohorts) > 1 for cohorts, _ in steps), "no call ran two cohorts"


def test_jacobi_steps_through_the_same_three_parts(loaded):
    from fairseq_stream.jacobi import decoder as jacobi_module

    models, task = loaded("transformer")
    greedy = BeamDecoder(models, task.target_dictionary, beam_size=1, runner="lean", keep_reference=False)
    greedy.compiled_loop = False
    dec = jacobi_module.JacobiDecoder(greedy, variant="pgj", block=3)
    sample = sorted_batches(task, 6, 40, subset="valid")[0]
    steps = jacobi_module._WindowSteps(dec, sample["id"].tolist(), torch.device("cpu"))
    assert isinstance(steps, CohortSteps) and not isinstance(steps, CohortDecoder)
    with torch.no_grad():
        ours = dec.generate(models, sample)
        reference = greedy.generate(models, sample)
    assert [h[0]["tokens"].tolist() for h in ours] == [h[0]["tokens"].tolist() for h in reference]
