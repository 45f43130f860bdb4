"""``--output-layer auto|fused|torch``: which output layer a decoder's steps use.

* ``torch``: the decoder's runner returns the ensemble's log-probabilities
  (fairseq's ``get_normalized_probs``), ``BeamDecoder`` applies the rules to
  the full matrix and takes ``topk`` (the reference).
* ``fused``: the runner returns each model's logits and
  :func:`fairseq_stream.ops.topk_log_softmax`'s compiled kernel turns them
  into each row's best candidates, the rules applied in the same pass.
* ``auto``: ``fused`` where a kernel is built for the models' device and
  nothing below rules it out, else ``torch``; ``--search fixed --finalize
  fairseq`` keeps ``torch`` (its promise is bitwise identity with fairseq)
  unless another runner than fairseq's is asked for (``--runner lean``),
  which gives that promise up.

What rules the fused layer out (a log line, then ``torch``):
``--no-repeat-ngram-size`` (it needs every word's log-probability), a model
whose output is not a plain log-softmax (adaptive softmax), more candidates
per row than the CUDA kernel keeps. ``fused`` without a built kernel for the
device is a one-line error.
"""

from typing import Optional

import torch

from fairseq_stream.errors import FairseqStreamError
from fairseq_stream.ops import loader, output_layer
from fairseq_stream.runners import say_once

OUTPUT_LAYERS = ("auto", "fused", "torch")


def check_output_layer(option: str) -> str:
    """``option`` if it names an output layer, else a one-line error."""
    option = str(option)
    if option not in OUTPUT_LAYERS:
        raise FairseqStreamError("--output-layer must be one of {}, got {}".format(", ".join(OUTPUT_LAYERS), option))
    return option


def choose_backend(option: str, runner, device: torch.device, n: int, keep_reference: bool = False,
                   no_repeat_ngram_size: int = 0) -> str:
    """The :func:`~fairseq_stream.ops.topk_log_softmax` backend a decoder uses, or "torch" for the reference path.

    Args:
        option: ``auto``, ``fused`` or ``torch``.
        runner: the decoder's runner (asked whether it can return logits).
        device: where the models run.
        n: the candidates kept per row.
        keep_reference: ``auto`` stays on the reference (``--search fixed
            --finalize fairseq``).
        no_repeat_ngram_size: fairseq's ``--no-repeat-ngram-size``.

    Returns:
        "torch" (the reference path: full log-probabilities, then the rules
        and ``topk``), or "cpu" / "cuda" (the compiled kernel).
    """
    option = check_output_layer(option)
    if option == "torch":
        return "torch"
    if option == "auto" and keep_reference:
        say_once("fairseq-stream: using the torch output layer (--search fixed --finalize fairseq is bitwise "
                 "fairseq's; --output-layer fused to change)")
        return "torch"
    kernel = output_layer.auto_backend(device)
    if kernel == "torch":
        if option == "fused":
            raise FairseqStreamError(
                "--output-layer fused: no compiled output layer for {} here (fairseq_stream._ops_{}: {}); "
                "build it with 'pip install --no-build-isolation -e .', or use --output-layer auto".format(
                    device.type, device.type, loader.missing_reason(device.type)))
        say_once("fairseq-stream: --output-layer auto: no compiled output layer for %s; using the torch "
                 "output layer", device.type)
        return "torch"
    reason = _fused_unsupported(runner, kernel, n, no_repeat_ngram_size)
    if reason:
        say_once("fairseq-stream: --output-layer %s: %s; using the torch output layer", option, reason)
        return "torch"
    say_once("fairseq-stream: using the fused output layer (%s kernel)", kernel)
    return kernel


def _fused_unsupported(runner, kernel: str, n: int, no_repeat_ngram_size: int) -> Optional[str]:
    if no_repeat_ngram_size > 0:
        return "--no-repeat-ngram-size needs every word's log-probability"
    reason = runner.logits_unsupported()
    if reason:
        return reason
    if kernel == "cuda" and n > output_layer.CUDA_MAX_N:
        return "the CUDA kernel keeps at most {} candidates per row, this search needs {}".format(
            output_layer.CUDA_MAX_N, n)
    return None
