"""Greedy decoding of one sentence on the lean runner, the whole loop in one compiled call (CPU).

One sentence at a time (``--batch-size 1``, the latency case), a greedy step
of the Multi30k transformer is little arithmetic: about 0.1 ms of products
in int8 on one Xeon thread. The Python loop around it (the runner's step,
the decoder's candidates, selection and bookkeeping) costs about as much
again. :func:`decode` (``csrc/cpu/greedy_loop_cpu.cpp``) runs the loop in
C++: per step the embedding, every model's compiled layers
(:mod:`fairseq_stream.ops.lean_step`), the output layer and the fused
log-softmax + rules + argmax (:mod:`fairseq_stream.ops.output_layer`, n = 1),
until EOS; fairseq's rules as the decoder applies them (``--min-len`` bans
EOS, the sentence's maximum length forces it, ``--unkpen``,
``--temperature``).

The same ops and kernels in the same order as the Python loop for one
sentence at beam 1, so the words and scores are bitwise the Python loop's
(tests/test_greedy_loop.py). It applies where every model's layers are
compiled (:func:`describe` is not None) and the models are float32 on the CPU.
"""

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from fairseq_stream.ops import lean_step
from fairseq_stream.ops.output_layer import compiled_module


def _extension():
    module = compiled_module("cpu")
    return module if module is not None and hasattr(module, "greedy_decode") else None


def describe(lean) -> Optional[object]:
    """The compiled description of a ``LeanModel`` (:mod:`fairseq_stream.runners.lean_model`), or None.

    None where the loop cannot run it: its layers are not compiled, or its
    weights are not float32 on the CPU.
    """
    module = _extension()
    if module is None or lean.compiled is None or lean.embed.dtype != torch.float32 or not lean.embed.is_cpu:
        return None
    products = [lean_step.product_of(module, p) if p is not None else None
                for p in (lean.project_in, lean.project_out, lean.output)]
    if any(p is None for p, wanted in zip(products, (lean.project_in, lean.project_out, lean.output)) if wanted):
        return None
    project_in, project_out, output = products

    def norm(n):
        return None if n is None else (n[1], n[2], n[3])

    return module.LeanDecoderModel(lean.embed, float(lean.embed_scale), lean.positions, project_in,
                                   norm(lean.embed_norm), lean.compiled, norm(lean.final_norm), project_out, output,
                                   int(lean.padding_idx), int(lean.heads), int(lean.head_dim))


def decode(models: List, encoders: List, *, bos: int, max_len: int, min_len: int, pad: int, eos: int,
           unk: Optional[int], unk_penalty: float, temperature: float) -> Tuple[Tensor, Tensor]:
    """One sentence's greedy words (EOS last) and the running sums of their log-probabilities (float32).

    ``models``: :func:`describe` of each model; ``encoders``: each model's
    ``EncoderKeys`` for the sentence (one sentence).
    """
    return _extension().greedy_decode(models, [e.keys for e in encoders], [e.values for e in encoders],
                                      [e.mask for e in encoders], int(bos), int(max_len), int(min_len), int(pad),
                                      int(eos), -1 if unk is None else int(unk), float(unk_penalty),
                                      float(temperature))
