"""Both finalization rules on hand-built candidate scores."""

import math

import pytest
import torch

from fairseq_stream.search.pruning import Pruning
from fairseq_stream.search.selection import select_fairseq, select_stay

NEG = -math.inf
EOS, PAD, V = 2, 1, 4  # words 0..3; 2 is EOS


def expand(rows):
    """(S, k, V) nested lists of cumulative scores -> (S, k * V) candidates."""
    t = torch.tensor(rows, dtype=torch.float)
    return t.view(t.size(0), -1)


def test_fairseq_finalizes_eos_in_the_best_k_and_continues_with_k_non_eos():
    # k = 2, one sentence. Best candidates: (slot0, EOS) -1.0, (slot0, w3) -1.1,
    # (slot1, w0) -1.3, (slot1, EOS) -1.4, ...
    cand = expand([[[-5.0, NEG, -1.0, -1.1], [-1.3, NEG, -1.4, -6.0]]])
    sel = select_fairseq(cand, cand, k=2, vocab=V, eos=EOS, pruning=Pruning())
    assert sel.eos_sentence.tolist() == [0] and sel.eos_slot.tolist() == [0]
    assert sel.eos_score.tolist() == [-1.0]
    # the EOS ranked 4th (-1.4) is outside the best k: not finalized
    assert sel.parent.tolist() == [[0, 1]] and sel.token.tolist() == [[3, 0]]
    assert sel.score[0].tolist() == pytest.approx([-1.1, -1.3])
    assert sel.live.all() and not sel.finished.any()


def test_fairseq_pruning_can_end_a_sentence_against_a_finished_hypothesis():
    cand = expand([[[-5.0, NEG, -4.0, -4.1], [-4.3, NEG, -4.4, -6.0]]])
    sel = select_fairseq(cand, cand, k=2, vocab=V, eos=EOS, pruning=Pruning(ap=1.0),
                         best_finished=torch.tensor([-0.5]))
    assert not sel.live.any() and sel.finished.tolist() == [True]
    assert sel.eos_sentence.numel() == 0  # the pruned EOS is dropped, not finalized


def test_stay_keeps_finished_candidates_on_the_beam_until_they_fall_off():
    # k = 2; slot 1 holds a finished hypothesis scoring -2.0.
    cand = expand([[[-1.0, NEG, -3.0, -1.5], [NEG] * 4]])
    done = torch.tensor([[NEG, -2.0]])
    sel = select_stay(cand, cand, done, k=2, vocab=V, eos=EOS, pad=PAD, pruning=Pruning())
    # two expansions beat the finished one (-1.0, -1.5): it falls off
    assert sel.score[0].tolist() == pytest.approx([-1.0, -1.5]) and sel.live.all()
    assert not sel.done.any() and not sel.finished.any()


def test_stay_keeps_decoding_below_a_finished_best_entry():
    cand = expand([[[-3.0, NEG, -2.5, -2.2], [NEG] * 4]])
    done = torch.tensor([[NEG, -2.0]])
    sel = select_stay(cand, cand, done, k=2, vocab=V, eos=EOS, pad=PAD, pruning=Pruning())
    assert sel.score[0].tolist() == pytest.approx([-2.0, -2.2])
    assert sel.done.tolist() == [[True, False]] and sel.parent[0, 0] == 1  # carried over
    assert sel.token[0, 0] == PAD and not sel.fresh[0, 0]
    assert sel.finished.tolist() == [False]  # a live entry is still on the beam


def test_stay_ends_the_sentence_when_no_live_entry_is_left():
    cand = expand([[[-3.0, NEG, -2.5, -2.2], [NEG] * 4]])
    done = torch.tensor([[NEG, -2.0]])
    # delta = 0.1 against the finished -2.0 prunes the live -2.2
    sel = select_stay(cand, cand, done, k=2, vocab=V, eos=EOS, pad=PAD, pruning=Pruning(ap=0.1))
    assert sel.done.tolist() == [[True, False]] and not sel.live.any()
    assert sel.finished.tolist() == [True]


def test_stay_marks_a_new_eos_as_fresh_and_lets_it_wait_below_the_best():
    cand = expand([[[-1.0, NEG, -1.2, -4.0], [NEG] * 4]])
    done = torch.full((1, 2), NEG)
    sel = select_stay(cand, cand, done, k=2, vocab=V, eos=EOS, pad=PAD, pruning=Pruning())
    assert sel.fresh.tolist() == [[False, True]] and sel.done.tolist() == [[False, True]]
    assert sel.live.tolist() == [[True, False]] and not sel.finished.any()


def test_stay_with_pruning_narrows_the_beam():
    cand = expand([[[-1.0, NEG, -1.2, -4.0], [NEG] * 4]])
    done = torch.full((1, 2), NEG)
    sel = select_stay(cand, cand, done, k=2, vocab=V, eos=EOS, pad=PAD, pruning=Pruning(rp=0.9))
    assert sel.live.tolist() == [[True, False]] and not sel.done.any()
