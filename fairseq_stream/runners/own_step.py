"""What every runner that runs the decoder step itself (lean, rnn) shares with the others."""

import math
from typing import List, Optional

import torch
from torch import Tensor


class OwnStepRunner:
    """The ensemble, its type and limits, and fairseq's normalization of each model's logits.

    Subclasses arrange the weights in ``_build`` (called again after
    :meth:`cuda`) and implement the runner interface (``start / step /
    step_mixed / reorder / take / concat``, and ``step_own``: their states
    join across lengths).

    Args:
        models: fairseq models (an ensemble of one or more) that the
            subclass's module's ``unsupported_reason`` accepts.
        temperature: divides the decoder logits, as fairseq's ``--temperature``.
    """

    def __init__(self, models, temperature: float = 1.0):
        from fairseq.sequence_generator import EnsembleModel

        self.model = EnsembleModel(list(models))
        self.model.eval()
        self.temperature = temperature

    def _build(self):
        raise NotImplementedError

    def cuda(self):
        self.model.cuda()
        self._build()  # the arranged weights are views or copies of the old tensors
        return self

    @property
    def dtype(self) -> torch.dtype:
        """The models' floating-point type."""
        from fairseq_stream.runners.base import module_dtype

        return module_dtype(self.model)

    def max_decoder_positions(self):
        return self.model.max_decoder_positions()

    @staticmethod
    def release_float_weights() -> int:
        """0 unless the runner quantizes its products and overrides this (the lean runner)."""
        return 0

    @staticmethod
    def logits_unsupported() -> Optional[str]:
        """Always None: every model these runners accept ends in a plain log-softmax."""
        return None

    def _ensemble(self, outs: List[Tensor], logits: bool):
        """Each model's logits as they are (``logits``), or the ensemble's log-probabilities."""
        if logits:
            return outs
        lprobs = [self._normalized(x) for x in outs]
        if len(lprobs) == 1:
            return lprobs[0]
        return torch.logsumexp(torch.stack(lprobs, dim=0), dim=0) - math.log(len(lprobs))

    def _normalized(self, logits: Tensor) -> Tensor:
        """One model's log-probabilities from its logits, as fairseq's runner computes them."""
        if self.temperature != 1.0:
            logits = logits.div_(self.temperature)
        # fairseq normalizes in float32 whatever the model's type; float64 stays float64.
        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        return torch.log_softmax(logits, dim=-1, dtype=dtype)
