"""A batch's greedy or beam search on the lean runner, the whole loop in one compiled call (CPU).

One sentence at a time (``--batch-size 1``, the latency case), a step of the
Multi30k transformer is little arithmetic: about 0.1 ms of products in int8
on one Xeon thread at beam 1. The Python loop around it (the runner's step,
the decoder's candidates, selection and bookkeeping) costs about as much
again at beam 1, and a third of the time at beam 5. The loop here runs
in C++ (``csrc/cpu/search_loop_cpu.cpp``: the engine's loop under the batch
planner compiled, one driver over two search policies in
``csrc/cpu/search_policy_cpu.cpp``; docs/architecture.md lists its phases
against the Python functions they compile): per step the embedding, every
model's compiled layers (:mod:`fairseq_stream.ops.lean_step`), the output
layer and the fused log-softmax + rules + top-k
(:mod:`fairseq_stream.ops.output_layer`), with fairseq's rules as the
decoder applies them (``--min-len`` bans EOS, the sentence's maximum length
forces it, ``--unkpen``, ``--temperature``); then

* :func:`greedy`: the argmax, until EOS, for a whole batch: a sentence's
  row leaves at the step after its EOS, as in the Python loop. In a batch
  of 64 a few sentences that never end run alone to the maximum length
  (half the steps of Multi30k's test set are one row), where the Python
  loop costs more than the row;
* :func:`beam`: fairseq's finalization (``--search fixed``), the compiled
  selection of :mod:`fairseq_stream.ops.beam_step` and the histories' and
  caches' move to the next beam (the caches by the lean runner's own
  function, :func:`fairseq_stream.ops.attention.follow_parents_`), until
  every sentence ends, a sentence's rows leaving at the step after it
  ends; it returns the finalized
  hypotheses, which the decoder scores and orders as its own.

The same ops and kernels in the same order, over the same rows, as the
Python loop, so words and scores are bitwise the Python loop's
(tests/test_search_loop.py). They apply where every model's layers are
compiled (:func:`describe` is not None) and the models are float32 on the CPU.
"""

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from fairseq_stream.ops import product
from fairseq_stream.ops.loader import compiled_module


# Each sentence's hypotheses [(words, cumulative scores)], and the steps each sentence ran.
Found = Tuple[List[List[Tuple[Tensor, Tensor]]], List[int]]


def _extension():
    module = compiled_module("cpu")
    return module if module is not None and hasattr(module, "beam_decode") else None


def describe(lean) -> Optional[object]:
    """The compiled description of a ``LeanModel`` (:mod:`fairseq_stream.runners.lean_model`), or None.

    None where the loop cannot run it: its layers are not compiled, or its
    weights are not float32 on the CPU.
    """
    module = _extension()
    if module is None or lean.compiled is None or lean.embed.dtype != torch.float32 or not lean.embed.is_cpu:
        return None
    products = [product.compiled(module, p) if p is not None else None
                for p in (lean.project_in, lean.project_out, lean.output)]
    if any(p is None for p, wanted in zip(products, (lean.project_in, lean.project_out, lean.output)) if wanted):
        return None
    project_in, project_out, output = products

    def norm(n):
        return None if n is None else (n[1], n[2], n[3])

    return module.LeanDecoderModel(lean.embed, float(lean.embed_scale), lean.positions, project_in,
                                   norm(lean.embed_norm), lean.compiled, norm(lean.final_norm), project_out, output,
                                   int(lean.padding_idx), int(lean.heads), int(lean.head_dim))


def _encoders(encoders: List):
    return [e.keys for e in encoders], [e.values for e in encoders], [e.mask for e in encoders]


def greedy(models: List, encoders: List, *, bos: int, max_lens: List[int], min_len: int, pad: int, eos: int,
           unk: Optional[int], unk_penalty: float, temperature: float) -> Found:
    """A batch's greedy search: each sentence's one hypothesis (words, EOS last, and the running sums of
    their log-probabilities in float32), and the steps each ran.

    ``models``: :func:`describe` of each model; ``encoders``: each model's
    ``EncoderKeys`` for the batch; ``max_lens``: each sentence's maximum length.
    """
    words, cumulative, lengths = _extension().greedy_decode(
        models, *_encoders(encoders), int(bos), [int(m) for m in max_lens], int(min_len), int(pad), int(eos),
        -1 if unk is None else int(unk), float(unk_penalty), float(temperature))
    sizes = lengths.tolist()
    return [[found] for found in zip(words.split(sizes), cumulative.split(sizes))], sizes


def beam(models: List, encoders: List, *, k: int, n: int, bos: int, max_lens: List[int], min_len: int, pad: int,
         eos: int, unk: Optional[int], unk_penalty: float, temperature: float) -> Found:
    """A batch's beam search of width ``k`` (``n`` candidates a row) with fairseq's finalization.

    Returns each sentence's finalized hypotheses in the order they were
    finalized, at most ``k``: each (words with EOS last, the running sums of
    their log-probabilities in float32, the last its final cumulative
    score); and the steps each sentence ran.
    """
    words, cumulative, lengths, counts, steps = _extension().beam_decode(
        models, *_encoders(encoders), int(k), int(n), int(bos), [int(m) for m in max_lens], int(min_len), int(pad),
        int(eos), -1 if unk is None else int(unk), float(unk_penalty), float(temperature))
    sizes = lengths.tolist()
    hyps = list(zip(words.split(sizes), cumulative.split(sizes)))
    per_sentence, at = [], 0
    for count in counts.tolist():
        per_sentence.append(hyps[at: at + count])
        at += count
    return per_sentence, steps.tolist()
