"""The compiled search: a whole batch's search in one compiled call, where that is exact.

The decoder's Python loop (:class:`~fairseq_stream.decoder.BeamDecoder`,
``open`` / ``advance``) is the one loop; this module is an accelerator the
decoder asks before running it, through two calls:

* :func:`applies` (decoder, source tokens): can this batch run in one
  compiled call and give the Python loop's hypotheses bitwise?
* :func:`search` (decoder, net_input, bos): then run it; None where the
  runner declines at run time (its compiled step or attention does not apply).

What it reads of the decoder: its settings (``compiled_loop``, ``dense``,
``finalize``, ``output_backend``, ``beam_size``, ``vocab_size``,
``repeat_ngram_blocker``, ``score_dtype``, ``stats``, ``candidates_per_row``,
the length rules and special symbols), its ``runner`` (``greedy_decode``,
``beam_decode``: ``runners/lean.py``, which hands them to
``ops/search_loop.py`` and ``ops/csrc/cpu/search_loop_cpu.cpp``) and its
finalizer (the hypotheses are scored as the Python loop scores them).
"""

from typing import Dict, List, Optional

import torch
from torch import Tensor

from fairseq_stream import hypotheses as hyp


def applies(decoder, src: Tensor) -> bool:
    """Whether the batch of ``src`` runs in one compiled call with the Python loop's hypotheses, bitwise.

    Not for an empty source, pruning or ``--finalize stay``, a beam of more
    than V - 3 words, the n-gram blocker, the reference output layer,
    per-step statistics, a score type other than float32, or a runner
    without the loops; nor where ``decoder.compiled_loop`` is False (the
    tests' reference).
    """
    d = decoder
    # The compiled loop extends live slots only: exact while the first step has k words to fill the beam
    # with (at most PAD, EOS and UNK are -inf there); a wider beam takes the Python loop, which extends
    # every slot as fairseq does (_next_beam).
    settings = (d.compiled_loop and d.dense and d.finalize == "fairseq" and d.output_backend == "cpu"
                and d.beam_size <= d.vocab_size - 3 and d.repeat_ngram_blocker is None
                and not d.stats.keep_steps and d.score_dtype == torch.float32 and hasattr(d.runner, "beam_decode"))
    return bool(settings and src.size(0) > 0 and bool((src.ne(d.eos) & src.ne(d.pad)).any(dim=1).all()))


def search(decoder, net_input, bos_token) -> Optional[Dict[int, List[Dict[str, Tensor]]]]:
    """The batch's search by the runner's compiled loop (``greedy_decode``, ``beam_decode``), or None.

    The hypotheses the Python loop makes, bitwise (tests/test_search_loop.py):
    the loop's words and cumulative scores, made into hypotheses, scored and
    ordered by the finalizer's arithmetic. Ask :func:`applies` first.
    """
    d = decoder
    src = net_input["src_tokens"]
    rules = dict(bos=d.eos if bos_token is None else bos_token, max_lens=d.max_lengths(src).tolist(),
                 min_len=d.min_len, pad=d.pad, eos=d.eos, unk=d.unk, unk_penalty=d.unk_penalty)
    if d.beam_size == 1:
        found = d.runner.greedy_decode(net_input, **rules)
    else:
        found = d.runner.beam_decode(net_input, k=d.beam_size, n=d.candidates_per_row, **rules)
    if found is None:
        return None
    per_sentence, steps = found
    scored = d.finalizer.score_finalized(
        [[_finalized_hypothesis(words, sums) for words, sums in finalized] for finalized in per_sentence], d.scores)
    _count_steps(d, steps)
    return {s: hyp.best_first(hyps, values) for s, (hyps, values) in enumerate(scored)}


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
