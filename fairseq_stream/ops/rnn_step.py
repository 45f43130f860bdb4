"""One ``--rnn-int16`` decoder step of a fairseq LSTM model as one compiled call (CPU).

The rnn runner's step (:mod:`fairseq_stream.runners.rnn`) is about 35
small torch ops around its three int16 products; one sentence at a time
(beam 5, one CPU thread) their dispatch cost about 150 us of a 390 us step
whose products take 190 us (docs/BENCHMARKS.md, issue 14). :func:`rnn_step`
(``csrc/cpu/rnn_step_cpu.cpp``) runs the same step in one call: the
products on the int16 kernel, and the LSTM cells, the attention over the
pre-computed source tables and its output in plain loops that the compiler
vectorizes, with Cephes' single-precision exp and tanh (Devlin 2017,
section 4.4: vectorized activations).

**Arithmetic.** The products are the int16 kernel's, bit for bit those of
the torch path. The rest is float32 in another order than torch's, and the
activations are approximations: :func:`exp_approx` is within 1 ulp of the
true exp on [-87, 88] and clamped outside it (so exp(-inf) is 1.6e-38, not
0; masked attention positions are skipped instead), NaN for NaN, :func:`sigmoid_approx`
and :func:`tanh_approx` within 1e-7 absolute, as torch's own float32 ones
(``tests/test_rnn_step.py`` checks these bounds). So the step's results
differ from the torch int16 step's by float rounding, far below the int16
products' own error: on 300 Multi30k test sentences (beam 5) every
translation was the same, with scores within 6e-5. Each row is computed on its own, so a row's
result does not depend on which rows share its call (batch, stream and
fifo give identical results).

It covers what ``--rnn-int16`` runs by default: any number of layers,
residuals, the attention with its pre-computed tables (or no attention),
``additional_fc``, the output layer in int16 or float
(``--no-rnn-int16-output``). Without the attention table the runner keeps
its torch step.
"""

from typing import List, Optional, Sequence, Tuple

from torch import Tensor

from fairseq_stream.ops import product as product_op
from fairseq_stream.ops.loader import compiled_module


def _extension():
    """The CPU module where it is built with the step; None: the runner keeps its torch step."""
    module = compiled_module("cpu")
    return module if hasattr(module, "rnn_step") else None


def available() -> bool:
    """Whether the compiled step is built (CPU extension)."""
    return _extension() is not None


def product(int16=None, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None):
    """A product for :func:`rnn_step`, the one op every compiled step takes (:mod:`fairseq_stream.ops.product`):
    ``int16``, an int16 ``Product`` itself, or a float ``weight`` (with ``bias``) in float32, as ``at::linear``."""
    if int16 is not None:
        return product_op.compiled(_extension(), int16)
    float_bias = None if bias is None else bias.detach().float().contiguous()
    return product_op.compiled(_extension(), product_op.linear(weight.detach().float().contiguous(), float_bias,
                                                               "plain"))


def rnn_step(x: Tensor, feed: Tensor, h: Tensor, c: Tensor, parent: Optional[Tensor], recurrent: Sequence,
             upper_input: Sequence, residuals: bool, keys: List[Tensor], values: List[Tensor], masks: List[Tensor],
             row_sentences: List[Tensor], out_hidden, additional_fc, output) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """One decoder step of one model over ``rows`` rows.

    Args:
        x: (rows, 4H) the first cell's input part (``W_e x + b``).
        feed, h, c: the parents' input feed (P, F) and states (layers, P, H).
        parent: (rows,) each row's parent, or None (row i is parent i).
        recurrent: one product per layer (the first on ``[feed; h]``);
            upper_input: one per layer above the first.
        keys, values, masks, row_sentences: per group of consecutive rows,
            its sentences' attention tables (S, T, H), padding mask (S, T)
            and each row's sentence; empty lists: no attention.
        out_hidden: the attention output's hidden half (None without attention).
        additional_fc, output: the products before the logits.

    Returns:
        (logits (rows, V), h (layers, rows, H), c (layers, rows, H), out (rows, H)),
        ``out`` being the next step's input feed.
    """
    logits, h_new, c_new, out = _extension().rnn_step(
        x, feed, h, c, parent, list(recurrent), list(upper_input), residuals, keys, values, masks, row_sentences,
        out_hidden, additional_fc, output)
    return logits, h_new, c_new, out


def exp_approx(x: Tensor) -> Tensor:
    """The step's exp, elementwise (float32; for tests)."""
    return _extension().exp_approx(x)


def sigmoid_approx(x: Tensor) -> Tensor:
    """The step's sigmoid, elementwise (float32; for tests)."""
    return _extension().sigmoid_approx(x)


def tanh_approx(x: Tensor) -> Tensor:
    """The step's tanh, elementwise (float32; for tests)."""
    return _extension().tanh_approx(x)
