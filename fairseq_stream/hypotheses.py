"""fairseq's hypothesis dicts, their scores and their order: made here for every decoder of ours.

A hypothesis is what fairseq's ``SequenceGenerator`` returns per entry of a
sentence's n-best list: ``tokens`` (EOS last), ``score`` (length-normalized),
``positional_scores``, and empty ``attention`` / ``alignment`` (nothing reads
them without ``--print-alignment``, which our searches refuse).
"""

from typing import Dict, List, Optional

import numpy as np
import torch
from torch import Tensor


def hypothesis(tokens: Tensor, positional_scores: Tensor, score: Optional[Tensor] = None) -> Dict[str, Tensor]:
    """One hypothesis dict (``score`` None: set by the caller once the batch's scores are read)."""
    return {
        "tokens": tokens,
        "score": score,
        "attention": torch.empty(0),
        "alignment": torch.empty(0),
        "positional_scores": positional_scores,
    }


def empty_hypothesis(eos: int, device) -> Dict[str, Tensor]:
    """What an empty source gets: EOS alone, score 0 (fairseq would translate the lone EOS into something)."""
    return hypothesis(torch.full((1,), eos, dtype=torch.long, device=device), torch.zeros(1, device=device),
                      torch.zeros((), device=device))


def score_tensors(values: List[float], score_dtype: torch.dtype, device) -> List[Tensor]:
    """Hypothesis scores as fairseq's: 0-d tensors on the models' device, one copy for all ``values``.

    The device is part of the printed score: fairseq-generate prints
    ``hypo["score"] / math.log(2)``, which on CUDA multiplies by the
    reciprocal (see :func:`normalized`) and on the CPU divides. Scores kept
    on the host put --search fixed one float32 ulp from fairseq's beam on
    104 of 674 printed hypotheses on an H100 (2026-11-27, docs/GPU.md).
    On CUDA the copy leaves from pinned memory without waiting for the device.
    """
    kind = torch.device(device).type
    if kind == "cuda":
        host = torch.tensor(values, dtype=score_dtype, pin_memory=True)
        return list(host.to(device, non_blocking=True).unbind(0))
    return list(torch.tensor(values, dtype=score_dtype, device=None if kind == "cpu" else device).unbind(0))


def normalized(finals: List[float], lens: List[int], score_dtype: torch.dtype, normalize: bool,
               len_penalty: float, reciprocal: bool = False) -> List[float]:
    """fairseq's hypothesis scores from cumulative ones, on the host.

    In the score type, divided per length as fairseq's ``eos_scores /=
    (step + 1) ** len_penalty`` divides on its device, so that scores and
    their ranking match bitwise: on the CPU a float32 division by the scalar
    rounded to float32; on CUDA (``reciprocal``) torch multiplies by the
    scalar's reciprocal instead, ``a * (1 / float32(b))`` (its
    BinaryDivTrueKernel.cu: "may lose one bit of precision"), which moved
    a score of --search fixed one ulp from fairseq's beam on 12 of 37 toy
    sentences on an H100 (2026-11-27).
    """
    dtype = np.float64 if score_dtype == torch.float64 else np.float32
    values = np.asarray(finals, dtype=np.float64).astype(dtype)
    if normalize:
        lengths = np.asarray([n ** len_penalty for n in lens], dtype=np.float64).astype(dtype)
        values = values * (dtype(1.0) / lengths) if reciprocal else values / lengths
    return values.tolist()


def best_first(hyps: list, values: List[float]) -> list:
    """``hyps`` sorted by score, best first, as ``torch.sort`` of their float32 scores would."""
    keys = np.asarray(values, dtype=np.float64).astype(np.float32).tolist()
    if len(set(keys)) == len(keys):
        # Distinct keys have one order: no need for torch.sort (not stable) to say which.
        order = sorted(range(len(keys)), key=keys.__getitem__, reverse=True)
    else:
        order = torch.sort(torch.tensor(keys), descending=True)[1].tolist()
    return [hyps[i] for i in order]
