"""What crosses between a process and its CPU workers (fairseq_stream/schedule/wire.py).

The toy transformer's real hypotheses (fixed and var-batch k=5, as a worker
decodes them: ``decode_samples``) go through the wire and come back as the
same pairs: ids, dict keys in order, every tensor's dtype, shape and bits,
contiguous and writable on its own (fairseq-generate divides
``positional_scores`` in place). What the columns cannot hold goes field by
field and comes back the same too.
"""

import pickle

import pytest
import torch

from conftest import decoder_options, sorted_batches
from fairseq_stream.decoder import BeamDecoder
from fairseq_stream.schedule.wire import _Array, _Columns, from_wire, to_wire
from fairseq_stream.schedule.workers import decode_samples


def over_the_wire(obj):
    return from_wire(pickle.loads(pickle.dumps(to_wire(obj), pickle.HIGHEST_PROTOCOL)))


def assert_same_pairs(got, sent):
    assert type(got) is list and len(got) == len(sent)
    for (got_id, got_hyps), (sent_id, sent_hyps) in zip(got, sent):
        assert got_id == sent_id and len(got_hyps) == len(sent_hyps)
        for a, b in zip(got_hyps, sent_hyps):
            assert list(a) == list(b)
            for key in b:
                if b[key] is None:
                    assert a[key] is None
                    continue
                assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
                assert torch.equal(a[key], b[key]), key
                assert a[key].is_contiguous()


@pytest.mark.parametrize("search", ["fixed", "var-batch"])
def test_a_workers_hypotheses_come_back_the_same(loaded, search):
    models, task = loaded("transformer")
    decoder = BeamDecoder(models, task.target_dictionary, **decoder_options(search))
    with torch.no_grad():
        pairs = decode_samples(decoder, models, sorted_batches(task, 16, 40))
    assert isinstance(to_wire(pairs), _Columns)
    got = over_the_wire(pairs)
    assert_same_pairs(got, pairs)
    # Each tensor is written on its own: fairseq-generate's in-place division touches no neighbour.
    first, second = got[0][1][0]["positional_scores"], got[0][1][1]["positional_scores"]
    before = second.clone()
    first.div_(2.0)
    assert torch.equal(first * 2.0, pairs[0][1][0]["positional_scores"]) and torch.equal(second, before)


def test_a_worker_sends_back_the_first_nbest_hypotheses_of_each_list(loaded):
    # What fairseq-generate and fairseq-interactive print (hypos[:nbest]); the rest never crosses the wire.
    models, task = loaded("transformer")
    decoder = BeamDecoder(models, task.target_dictionary, **decoder_options("fixed"))
    batches = sorted_batches(task, 16, 40)
    with torch.no_grad():
        whole = decode_samples(decoder, models, batches)
        trimmed = decode_samples(decoder, models, batches, nbest=2)
    assert all(len(hyps) == 5 for _, hyps in whole)
    assert_same_pairs(over_the_wire(trimmed), [(i, hyps[:2]) for i, hyps in whole])


def test_what_the_columns_cannot_hold_goes_field_by_field(loaded):
    models, task = loaded("transformer")
    decoder = BeamDecoder(models, task.target_dictionary, **decoder_options("greedy"))
    with torch.no_grad():
        pairs = decode_samples(decoder, models, sorted_batches(task, 8, 8))
    odd = [dict(h) for h in pairs[1][1]]
    odd[0]["score"] = None  # a score not yet set
    unusual = [pairs[0], (pairs[1][0], odd)]
    square = [(pairs[0][0], [dict(pairs[0][1][0], attention=torch.zeros(2, 3))])]  # a 2-D field
    for obj in (unusual, square, [], [(0, [])]):
        wired = to_wire(obj)
        assert not isinstance(wired, _Columns)
        assert_same_pairs(over_the_wire(obj), obj)
    assert isinstance(to_wire(torch.ones(2)), _Array)
