"""What every model runner is: the interface the decoder, the pool and Jacobi drive.

A runner encodes sentences into a *state* (one per group of rows: the rows'
encoder outputs and decoder caches) and runs single-token decoder steps over
it; the search and the scheduler choose rows, the runner only moves their
state. The fairseq runner (:mod:`fairseq_stream.runners.fairseq_runner`) is
the reference every other runner is tested against.
"""

from typing import List, Optional, Protocol, Tuple, runtime_checkable

import torch
from torch import Tensor


@runtime_checkable
class RowGroup(Protocol):
    """A runner's state of a group of rows (each runner has its own layout)."""

    @property
    def rows(self) -> int:
        """How many decoder rows the state holds."""


@runtime_checkable
class Runner(Protocol):
    """The runner interface.

    ``joins_lengths``: whether states whose rows have decoded different
    numbers of tokens may be joined (``concat(any_length=True)``) and stepped
    together by ``step_own``; the fairseq runner's incremental states hold one
    length per group, so it cannot.
    """

    name: str
    joins_lengths: bool
    temperature: float

    def max_decoder_positions(self) -> int:
        """The longest output the models decode."""

    @property
    def dtype(self) -> torch.dtype:
        """The models' floating-point type."""

    def cuda(self) -> "Runner":
        """Move the models (and whatever the runner arranged from them) to the GPU."""

    def logits_unsupported(self) -> Optional[str]:
        """Why :meth:`step` cannot return raw logits for these models (None: it can)."""

    def start(self, net_input, rows_per_sentence: int, sentence_ids: Optional[Tensor] = None) -> RowGroup:
        """Encode ``net_input``; ``rows_per_sentence`` decoder rows per sentence, nothing decoded yet."""

    def step(self, state: RowGroup, tokens: Tensor, logits: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
        """One decoder step of every row given its prefix ``tokens``; (log-probabilities or logits, attention)."""

    def step_mixed(self, states: List[RowGroup], last_tokens: Tensor, lengths: List[int],
                   logits: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
        """One step of several groups at different lengths in one call."""

    def reorder(self, state: RowGroup, new_order: Tensor) -> RowGroup:
        """The state's rows selected, duplicated or dropped by ``new_order``.

        A runner whose ``sync_free`` is true also takes ``sentence_rows``, the
        host's count of each sentence's new rows, and then reads nothing back
        from the device (the lean runner off the CPU).
        """

    def take(self, state: RowGroup, rows: Tensor) -> RowGroup:
        """A state holding only ``rows`` (the rest left to ``state``)."""

    def concat(self, states: List[RowGroup], any_length: bool = False) -> RowGroup:
        """The groups joined, rows in order."""

    def step_own(self, states: List[RowGroup], last_tokens: Tensor,
                 logits: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
        """One step of groups whose rows are each at its own length (joined by ``concat(any_length=True)``);
        ``last_tokens`` (rows, 1) are the rows' last tokens. Only where ``joins_lengths`` holds: the fairseq
        runner refuses it."""

    def release_float_weights(self) -> int:
        """Free the float weights that only quantized products read (``--quantize``); the bytes freed (0 where
        no product is quantized, or the runner keeps them). Only where the runner owns the models."""


@runtime_checkable
class CompiledLoopRunner(Protocol):
    """A runner whose models the compiled search loop drives (:mod:`fairseq_stream.compiled_search`): the lean
    runner. It only hands out what the loop reads; the search itself is the loop's, not the runner's."""

    temperature: float

    def compiled_loop_inputs(self, net_input) -> Optional[Tuple[list, list]]:
        """(each model's compiled-loop weights, each one's encoder keys of ``net_input``), or None where the
        compiled loop does not apply to these models (then the Python loop steps the runner)."""


def _first_floating(module: torch.nn.Module) -> Optional[Tensor]:
    """The module's first floating-point parameter, else its first floating-point buffer, else None.

    A model need not have parameters: fairseq's own generator tests decode
    with models that compute fixed probabilities from no weights at all.
    """
    return next(_tensors(module, Tensor.is_floating_point), None)


def _tensors(module: torch.nn.Module, keep):
    for tensors in (module.parameters(), module.buffers()):
        yield from (t for t in tensors if keep(t))


def module_dtype(module: torch.nn.Module) -> torch.dtype:
    """The floating-point type a model computes in (float32 for a model without weights)."""
    t = _first_floating(module)
    return t.dtype if t is not None else torch.float32


def module_device(module: torch.nn.Module, default: Optional[torch.device] = None) -> torch.device:
    """The device a model's weights live on (``default``, else the CPU, for a model without weights)."""
    t = next(_tensors(module, lambda t: True), None)
    if t is not None:
        return t.device
    return default if default is not None else torch.device("cpu")
