"""The compiled search: a whole batch's search in one compiled call, where that is exact.

The engine's Python loop (:class:`~fairseq_stream.engine.Engine` over the
decoder's ``open`` and its step's parts) is the one loop; this module, the
engine compiled for the batch planner, is an accelerator the decoder asks
before running it, through two calls:

* :func:`applies` (decoder, source tokens): can this batch run in one
  compiled call and give the Python loop's hypotheses bitwise?
* :func:`search` (decoder, net_input, bos): then run it; None where the
  runner declines at run time (its compiled step or attention does not apply).

What it reads of the decoder: its settings (``compiled_loop``, ``dense``,
``finalize``, ``output_backend``, ``beam_size``, ``vocab_size``,
``repeat_ngram_blocker``, ``score_dtype``, ``stats``, ``candidates_per_row``,
the length rules and special symbols), its ``runner`` and its finalizer
(the hypotheses are scored as the Python loop scores them).

The runner only hands out what the loop reads: a
:class:`~fairseq_stream.runners.base.CompiledLoopRunner` (the lean runner)
gives its models' loop weights and encoder keys
(``compiled_loop_inputs``), and :func:`greedy_decode` / :func:`beam_decode`
run the search over them (``ops/search_loop.py``,
``ops/csrc/cpu/search_loop_cpu.cpp``): the search is this layer's, not the
runner's.
"""

from typing import Dict, List, Optional

import torch
from torch import Tensor

from fairseq_stream import hypotheses as hyp
from fairseq_stream.ops import search_loop
from fairseq_stream.runners.base import CompiledLoopRunner


def applies(decoder, src: Tensor) -> bool:
    """Whether the batch of ``src`` runs in one compiled call with the Python loop's hypotheses, bitwise.

    Not for an empty source, pruning or ``--finalize stay``, a beam of more
    than V - 3 words, the n-gram blocker, the reference output layer,
    per-step statistics, a score type other than float32, or a runner
    that is not a ``CompiledLoopRunner``; nor where
    ``decoder.compiled_loop`` is False (the tests' reference).
    """
    d = decoder
    # The compiled loop extends live slots only: exact while the first step has k words to fill the beam
    # with (at most PAD, EOS and UNK are -inf there); a wider beam takes the Python loop, which extends
    # every slot as fairseq does (_next_beam).
    settings = (d.compiled_loop and d.dense and d.finalize == "fairseq" and d.output_backend == "cpu"
                and d.beam_size <= d.vocab_size - 3 and d.repeat_ngram_blocker is None and not d.stats.keep_steps
                and d.score_dtype == torch.float32 and isinstance(d.runner, CompiledLoopRunner))
    return bool(settings and src.size(0) > 0 and bool((src.ne(d.eos) & src.ne(d.pad)).any(dim=1).all()))


def search(decoder, net_input, bos_token) -> Optional[Dict[int, List[Dict[str, Tensor]]]]:
    """The batch's search by the compiled loop (:func:`greedy_decode`, :func:`beam_decode`), or None.

    The hypotheses the Python loop makes, bitwise (tests/test_search_loop.py):
    the loop's words and cumulative scores, made into hypotheses, scored and
    ordered by the finalizer's arithmetic. Ask :func:`applies` first.
    """
    d = decoder
    src = net_input["src_tokens"]
    rules = dict(bos=d.eos if bos_token is None else bos_token, max_lens=d.max_lengths(src).tolist(),
                 min_len=d.min_len, pad=d.pad, eos=d.eos, unk=d.unk, unk_penalty=d.unk_penalty)
    if d.beam_size == 1:
        found = greedy_decode(d.runner, net_input, **rules)
    else:
        found = beam_decode(d.runner, net_input, k=d.beam_size, n=d.candidates_per_row, **rules)
    if found is None:
        return None
    per_sentence, steps = found
    scored = d.finalizer.score_finalized(
        [[_finalized_hypothesis(words, sums) for words, sums in finalized] for finalized in per_sentence], d.scores)
    _count_steps(d, steps)
    return {s: hyp.best_first(hyps, values) for s, (hyps, values) in enumerate(scored)}


@torch.no_grad()
def greedy_decode(runner: CompiledLoopRunner, net_input, **rules):
    """A batch decoded greedily in one compiled call (:func:`fairseq_stream.ops.search_loop.greedy`) over the
    runner's models.

    ``rules``: ``bos, max_lens`` (one per sentence), ``min_len, pad, eos,
    unk, unk_penalty``. Returns each sentence's [(words, cumulative scores
    float32)], EOS last, and the steps each ran: bitwise what the
    decoder's Python loop computes for the batch at beam 1; None where the
    compiled loop does not apply.
    """
    return _in_one_call(search_loop.greedy, runner, net_input, rules)


@torch.no_grad()
def beam_decode(runner: CompiledLoopRunner, net_input, **rules):
    """A batch's beam search in one compiled call (:func:`fairseq_stream.ops.search_loop.beam`) over the
    runner's models.

    ``rules``: ``k, n, bos, max_lens, min_len, pad, eos, unk,
    unk_penalty``. Returns each sentence's finalized hypotheses as
    (words, cumulative scores) pairs in finalization order, and the steps
    each ran: bitwise the decoder's Python loop's under fairseq's
    finalization; None where it does not apply.
    """
    return _in_one_call(search_loop.beam, runner, net_input, rules)


def _in_one_call(loop, runner: CompiledLoopRunner, net_input, rules):
    inputs = runner.compiled_loop_inputs(net_input)
    if inputs is None:
        return None
    models, encoders = inputs
    return loop(models, encoders, temperature=runner.temperature, **rules)


def _finalized_hypothesis(words: Tensor, cumulative: Tensor) -> Dict[str, Tensor]:
    """A hypothesis from a compiled loop's words and running sums, as fairseq's finalization makes it."""
    positional = cumulative.clone()
    positional[1:] = positional[1:] - positional[:-1]
    return dict(hyp.hypothesis(words, positional), _final=cumulative[-1])


def _count_steps(decoder, lengths: List[int]):
    """The statistics of the Python loop's steps for sentences that ran ``lengths`` steps: at step t
    every sentence still running holds its k rows."""
    for length in range(1, max(lengths) + 1):
        decoder.stats.add_step(length, decoder.beam_size * sum(n >= length for n in lengths), 0.0)
