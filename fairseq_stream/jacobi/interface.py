"""What Jacobi's loop needs of the greedy decoder whose tokens it reproduces: one declared interface.

:class:`~fairseq_stream.jacobi.decoder.JacobiDecoder` and its calibration
(:mod:`~fairseq_stream.jacobi.calibration`) reach the greedy
:class:`~fairseq_stream.decoder.BeamDecoder` through :class:`GreedyDecoder`
only (tests/test_layering.py checks both). The decoder satisfies it as it
is: Jacobi is a driver over greedy's rules, not a second decoder reaching
into the first. What it asks, by purpose:

* the models: ``runner``, read once, to run windows on
  (:class:`~fairseq_stream.runners.lean_window.WindowRunner`);
* the rules: the special symbols, the length rules and the n-gram blocker
  (which Jacobi refuses);
* the output layer at every window position: ``top_candidates``;
* the scores: ``score_dtype`` and ``scores``;
* greedy's own decode, for batches where windows do not pay, and its
  counters (``generate``, ``stats``), a copy at other lengths for the
  calibration (``with_lengths``), and ``cuda``.
"""

from typing import List, Optional, Protocol, Tuple, runtime_checkable

import torch
from torch import Tensor

from fairseq_stream.runners.base import Runner
from fairseq_stream.stats import DecodeStats


@runtime_checkable
class GreedyDecoder(Protocol):
    """The greedy decoder as a Jacobi driver sees it (beam 1; :class:`~fairseq_stream.decoder.BeamDecoder`)."""

    runner: Runner  # its models; Jacobi's windows run on them (a lean runner)
    eos: int
    pad: int
    min_len: int  # EOS is banned below it
    repeat_ngram_blocker: Optional[object]  # fairseq's --no-repeat-ngram-size blocker, or None
    output_backend: str  # "torch", "cpu" or "cuda": the output layer
    score_dtype: torch.dtype  # what scores accumulate in
    stats: DecodeStats  # the run's counters: greedy's steps and Jacobi's calls alike

    def max_lengths(self, src_tokens: Tensor) -> Tensor:
        """Each sentence's maximum output length (EOS is forced there)."""

    def top_candidates(self, logits, n: int, ban_eos=None, force_eos: Optional[Tensor] = None, check: bool = True):
        """Each row's ``n`` best words from the models' ``logits`` by greedy's rules and output layer."""

    def scores(self, finals: List[float], lens: List[int]) -> Tuple[List[float], List[Tensor]]:
        """Hypothesis scores from cumulative ones, as greedy makes them: (values, fairseq's score tensors)."""

    def generate(self, models, sample, prefix_tokens=None, constraints=None, bos_token=None, **kwargs):
        """Greedy's own decode of a fairseq sample (one hypothesis list per sentence)."""

    def with_lengths(self, max_len_a: float, max_len_b: int, min_len: int) -> "GreedyDecoder":
        """A copy sharing the runner, with other length rules and counters of its own."""

    def cuda(self) -> "GreedyDecoder":
        """Move the models to the GPU."""
