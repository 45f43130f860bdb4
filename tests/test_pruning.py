"""Each pruning heuristic on hand-built candidate scores (Freitag & Al-Onaizan 2017)."""

import math

import pytest
import torch

from fairseq_stream.errors import FairseqStreamError
from fairseq_stream.search.pruning import Pruning

NEG = -math.inf


def candidates():
    # One sentence, candidates sorted best first: log-probabilities.
    scores = torch.tensor([[-1.0, -1.2, -2.0, -2.6, -4.0, NEG]])
    local = torch.tensor([[-0.1, -0.3, -0.2, -1.5, -0.5, NEG]])
    parents = torch.tensor([[0, 0, 1, 0, 0, 0]])
    carried = torch.zeros_like(scores, dtype=torch.bool)
    return scores, local, parents, carried


def test_no_heuristic_keeps_every_real_candidate():
    assert Pruning().keep(*candidates()).tolist() == [[True] * 5 + [False]]


def test_relative_threshold_compares_probabilities_to_the_best():
    # exp(-2.0) / exp(-1.0) = 0.37 >= 0.3; exp(-2.6 + 1.0) = 0.20 < 0.3
    keep = Pruning(rp=0.3).keep(*candidates())
    assert keep.tolist() == [[True, True, True, False, False, False]]


def test_rp_one_keeps_only_the_best():
    assert Pruning(rp=1.0).keep(*candidates()).tolist() == [[True] + [False] * 5]


def test_absolute_threshold_is_a_log_distance_from_the_best():
    keep = Pruning(ap=1.5).keep(*candidates())  # keep scores >= -2.5
    assert keep.tolist() == [[True, True, True, False, False, False]]


def test_absolute_threshold_counts_an_earlier_finished_hypothesis_as_best():
    keep = Pruning(ap=1.5).keep(*candidates(), best_finished=torch.tensor([-0.4]))
    assert keep.tolist() == [[True, True, False, False, False, False]]  # keep >= -1.9


def test_relative_local_threshold_looks_at_the_last_word_only():
    # best local -0.1; log(0.5) = -0.69: keep local >= -0.79
    keep = Pruning(rpl=0.5).keep(*candidates())
    assert keep.tolist() == [[True, True, True, False, True, False]]


def test_max_candidates_per_node_keeps_the_best_m_of_each_parent():
    keep = Pruning(mc=2).keep(*candidates())
    # parent 0 has candidates 0, 1, 3, 4: only 0 and 1 survive; parent 1 keeps 2.
    assert keep.tolist() == [[True, True, True, False, False, False]]


def test_carried_finished_candidates_are_exempt_from_local_and_node_limits():
    scores, local, parents, carried = candidates()
    carried[0, 3] = True
    keep = Pruning(mc=1, rpl=0.9).keep(scores, local, parents, carried)
    assert keep.tolist() == [[True, False, True, True, False, False]]


def test_heuristics_combine_as_a_conjunction():
    keep = Pruning(ap=1.5, mc=1).keep(*candidates())
    assert keep.tolist() == [[True, False, True, False, False, False]]


def test_rows_are_independent_sentences():
    scores = torch.tensor([[-1.0, -3.0], [-5.0, -5.5]])
    local = torch.zeros_like(scores)
    keep = Pruning(ap=1.0).keep(scores, local, torch.zeros_like(scores, dtype=torch.long),
                               torch.zeros_like(scores, dtype=torch.bool))
    assert keep.tolist() == [[True, False], [True, True]]


@pytest.mark.parametrize(
    "kwargs, flag",
    [({"rp": 0.0}, "--prune-rp"), ({"rp": 1.5}, "--prune-rp"), ({"rpl": -0.1}, "--prune-rpl"),
     ({"ap": -1.0}, "--prune-ap"), ({"mc": 0}, "--prune-mc")],
)
def test_invalid_values_are_refused_with_the_option_name(kwargs, flag):
    with pytest.raises(FairseqStreamError, match=flag):
        Pruning(**kwargs)
