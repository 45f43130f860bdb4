"""The parts a :class:`~fairseq_stream.decoder.BeamDecoder` is handed: its runner, its output backend and its
search policy.

``build.py`` assembles them from the parsed options (:func:`parts`,
:func:`policy`) and hands them to the decoder ready; a decoder given names
instead (tests, benchmarks: ``BeamDecoder(models, d, runner="lean")``) asks
:func:`parts` and :func:`policy` the same. The decoder asks :func:`output_backend` again only when it moves
to CUDA (the kernel follows the models' device).

The names:
    runner: ``fairseq`` (the reference), ``lean``, ``rnn`` or ``auto``; see
        :func:`fairseq_stream.runners.build_runner`.
    output_layer: ``torch`` (the reference), ``fused`` or ``auto``; see
        :mod:`fairseq_stream.output_choice`.
    keep_reference: ``auto`` runner and output layer stay on the references
        (fairseq, torch); default (None): when the search is dense (fixed
        width, ``--finalize fairseq``), whose promise is bitwise identity
        with fairseq's SequenceGenerator. The promise needs fairseq's runner:
        on another one (asked for by ``runner``), the ``auto`` output layer
        is the fused one.
    rnn_options: the rnn runner's tricks
        (:class:`~fairseq_stream.runners.rnn.RnnOptions`; default: all on,
        int16 off).
    quantize: ``none``, ``int8`` (``int8w8``, ``int8w7``) or ``int16``
        (``--quantize``): the products on weights quantized at load.
    stack_members: the lean and static-slot runners stack an ensemble's members of one shape
        (:mod:`fairseq_stream.runners.stacked`) where True, steps them one
        after another where False; None (``--stack-members auto``) stacks
        where their step is not compiled.
"""

from typing import Optional

from fairseq_stream.candidates import per_row
from fairseq_stream.errors import FairseqStreamError
from fairseq_stream.output_choice import check_output_layer, choose_backend
from fairseq_stream.runners import build_runner
from fairseq_stream.search.policies import search_policy
from fairseq_stream.search.pruning import Pruning


FINALIZE_MODES = ("fairseq", "stay")


def check_rules(finalize: str, temperature: float):
    """One-line errors for a finalization rule or temperature the loop does not take."""
    if finalize not in FINALIZE_MODES:
        raise FairseqStreamError(
            "--finalize must be one of {}, got {}".format(", ".join(FINALIZE_MODES), finalize)
        )
    if temperature <= 0:
        raise FairseqStreamError("--temperature must be greater than 0")


def is_dense(finalize: str, pruning) -> bool:
    """Whether every slot is a decoder row (fairseq's exact arithmetic, as in SequenceGenerator): fairseq's
    finalization without an active pruning heuristic."""
    return finalize == "fairseq" and not (pruning is not None and pruning.active)


def keeps_reference(finalize: str, pruning, keep_reference: Optional[bool]) -> bool:
    """``keep_reference`` resolved: by default, where the search is dense."""
    return is_dense(finalize, pruning) if keep_reference is None else keep_reference


def parts(models, tgt_dict, beam_size: int = 5, finalize: str = "fairseq", pruning=None, temperature: float = 1.0,
          no_repeat_ngram_size: int = 0, runner: str = "fairseq", output_layer: str = "torch",
          keep_reference: Optional[bool] = None, rnn_options=None, quantize: str = "none",
          stack_members: Optional[bool] = None):
    """(runner, output backend) of a decoder with these settings (the names: see the module docstring)."""
    check_rules(finalize, temperature)
    keep = keeps_reference(finalize, pruning, keep_reference)
    built = build_runner(runner, models, temperature=temperature, keep_fairseq=keep, rnn_options=rnn_options,
                         quantize=quantize, stack_members=stack_members)
    V = len(tgt_dict)
    n = per_row(beam_width(beam_size, V), V, finalize, pruning is not None and pruning.active)
    return built, output_backend(built, check_output_layer(output_layer), keep, n, no_repeat_ngram_size)


def beam_width(beam_size: int, vocab_size: int) -> int:
    """A decoder's beam: ``beam_size`` slots, at most the words but one (fairseq's ``min(beam, V - 1)``)."""
    return min(beam_size, vocab_size - 1)


def output_backend(runner, output_layer: str, keep_reference: bool, candidates_per_row: int,
                   no_repeat_ngram_size: int) -> str:
    """The output backend for ``runner`` on its models' device (:func:`fairseq_stream.output_choice.choose_backend`)."""
    from fairseq_stream.runners.base import module_device
    from fairseq_stream.runners.fairseq_runner import ModelRunner

    # Bitwise fairseq needs fairseq's runner and output layer together: without the one, the other keeps nothing.
    bitwise = keep_reference and isinstance(runner, ModelRunner)
    return choose_backend(output_layer, runner, module_device(runner.model), candidates_per_row,
                          keep_reference=bitwise, no_repeat_ngram_size=no_repeat_ngram_size)


def policy(tgt_dict, beam_size: int = 5, finalize: str = "fairseq", pruning=None):
    """The search policy of a decoder with these settings (:func:`fairseq_stream.search.policies.search_policy`):
    its beam as wide as the decoder's, at most the words but one."""
    V = len(tgt_dict)
    return search_policy(finalize, beam_width(beam_size, V), V, tgt_dict.eos(), tgt_dict.pad(), pruning or Pruning(),
                         is_dense(finalize, pruning))
