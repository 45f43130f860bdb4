"""Model runners behind one interface (``start / step / step_mixed / reorder / take / concat``).

Runners whose states hold rows of different prefix lengths (``joins_lengths``:
lean, rnn) also take ``concat(states, any_length=True)`` and ``step_own``, a
step of every row at its own length (:meth:`fairseq_stream.cohort.Cohort.merge`).

* ``fairseq``: :class:`fairseq_stream.runners.fairseq_runner.ModelRunner`, fairseq's own
  ``EnsembleModel`` calls; the reference every other runner is tested against.
* ``lean``: :class:`fairseq_stream.runners.lean.LeanRunner`, our own
  incremental step for fairseq transformers (preallocated caches, encoder keys
  shared by a sentence's rows, fused projections).
* ``rnn``: :class:`fairseq_stream.runners.rnn.RnnRunner`, our own step for
  fairseq LSTM models with Devlin (2017)'s tricks; ``--rnn-int16`` adds its
  16-bit fixed-point products.
* ``static``: :class:`fairseq_stream.runners.static_slots.StaticSlotRunner`, the lean step over
  key/value slots allocated once (issue 53, stage 2): reorder, take and concat move indices, a
  step's shapes stay fixed; chosen by name only (``auto`` never takes it).

``--quantize int8|int8w8|int8w7|int16`` runs every product on weights quantized once at
load (:mod:`fairseq_stream.ops.quantized_linear`): on the lean runner for
transformers, and (int16) the rnn runner's ``--rnn-int16`` for LSTMs.

``auto`` takes ``lean`` where every model of the ensemble is a supported
transformer, ``rnn`` where every one is a supported LSTM, and ``fairseq``
otherwise, and says which once in the log.

Dropout kept while decoding (fairseq's ``--retain-dropout``, Monte Carlo
dropout) is applied by fairseq's modules only: our runners' steps have no
dropout. So ``auto`` takes the fairseq runner for such models, and our runners
asked for by name (or ``--quantize``, ``--rnn-int16``, which need them) are a
one-line error, not a decode without the dropout the user asked for.
"""

import logging

from fairseq_stream.errors import FairseqStreamError
from fairseq_stream.ops import quantized_linear
from fairseq_stream.ops.quantized_linear import INT8_KINDS

logger = logging.getLogger(__name__)

RUNNERS = ("auto", "fairseq", "lean", "rnn", "static")
QUANTIZE = ("none",) + quantized_linear.CHOICES
_said = set()


def say_once(message, *args, level=logging.INFO):
    """Log ``message % args`` (at INFO unless ``level``), once per process (decoders are built per batch by
    some callers, and twice by ``--search fixed``)."""
    key = message % args
    if key not in _said:
        _said.add(key)
        logger.log(level, message, *args)


def check_runner(kind: str, int16: bool = False, quantize: str = "none", stack_members=None):
    """Refuse an unknown runner or ``--quantize``, and combinations no runner runs, in one line.

    ``stack_members``: True where ``--stack-members on`` was asked for (the
    lean and static runners' form), "on" as the option's text is taken too.
    """
    if kind not in RUNNERS:
        raise FairseqStreamError("--runner must be one of {}, got {}".format(", ".join(RUNNERS), kind))
    if quantize not in QUANTIZE:
        raise FairseqStreamError("--quantize must be one of {}, got {}".format(", ".join(QUANTIZE), quantize))
    if int16 and kind in ("fairseq", "lean", "static"):
        raise FairseqStreamError("--rnn-int16 runs on the rnn runner, not --runner {}".format(kind))
    if quantize != "none" and kind in ("fairseq", "static"):
        raise FairseqStreamError("--quantize runs on our runners (lean, rnn), not --runner {}".format(kind))
    if int16 and quantize in INT8_KINDS:
        raise FairseqStreamError("--rnn-int16 and --quantize {} ask for two precisions; use one".format(quantize))
    if stack_members in (True, "on") and (kind in ("fairseq", "rnn") or int16):
        raise FairseqStreamError("--stack-members on runs on our transformer runners (lean, static), not {}"
                                 .format("--rnn-int16" if int16 else "--runner " + kind))


def build_runner(kind: str, models, temperature: float = 1.0, keep_fairseq: bool = False, rnn_options=None,
                 quantize: str = "none", stack_members=None):
    """The runner ``kind`` for ``models``.

    Our runners (lean, rnn) keep freed memory in the process for reuse
    (:mod:`fairseq_stream.malloc_policy`): each batch's caches reuse the
    last one's pages instead of faulting fresh ones in.

    Args:
        kind: ``auto``, ``fairseq``, ``lean``, ``rnn`` or ``static``.
        keep_fairseq: ``auto`` keeps the fairseq runner (``--search fixed
            --finalize fairseq``, whose promise is bitwise identity with
            fairseq's SequenceGenerator).
        rnn_options: the RNN runner's tricks
            (:class:`~fairseq_stream.runners.rnn.RnnOptions`); with ``int16``
            the RNN runner is required: anything else is a one-line error.
        quantize: ``none``, ``int8`` (``int8w8``, ``int8w7``) or ``int16`` (``--quantize``): the lean
            runner's quantized products for transformers, the rnn runner's
            int16 for LSTMs; a model neither runs is a one-line error, never
            a silent float run.
        stack_members: the lean and static-slot runners run an ensemble whose
            members share a shape as one stacked model
            (:mod:`fairseq_stream.runners.stacked`) where True, member by member
            where False; None: stacked where the members' step is not compiled
            (:class:`LeanRunner`; the static-slot runner: where the compiled
            attention does not run). The log says which.
    """
    from fairseq_stream import malloc_policy
    from fairseq_stream.runners.fairseq_runner import ModelRunner

    runner = _choose_runner(kind, models, temperature, keep_fairseq, rnn_options, quantize, stack_members)
    if not isinstance(runner, ModelRunner):
        malloc_policy.keep_freed_memory()
    return runner


def _choose_runner(kind, models, temperature, keep_fairseq, rnn_options, quantize, stack_members):
    from fairseq_stream.runners.fairseq_runner import ModelRunner
    from fairseq_stream.runners import rnn

    options = rnn_options or rnn.RnnOptions()
    check_runner(kind, options.int16, quantize, stack_members)
    members = list(getattr(models, "models", models))
    dropout = retained_dropout(members)
    if dropout:
        if kind in ("lean", "rnn", "static") or quantize != "none" or options.int16:
            asked = "--quantize " + quantize if quantize != "none" else (
                "--rnn-int16" if options.int16 else "--runner " + kind)
            raise FairseqStreamError("--retain-dropout keeps dropout while decoding ({}), which only the fairseq "
                                     "runner applies: {} runs without it; drop one of the two".format(dropout, asked))
        if kind == "auto":
            say_once("fairseq-stream: using the fairseq runner (--retain-dropout keeps dropout while decoding "
                     "(%s), which only it applies)", dropout)
        return ModelRunner(models, temperature=temperature)
    rnn_reason = next((r for r in map(rnn.unsupported_reason, members) if r), None)
    if quantize != "none":
        return _quantized_runner(kind, members, temperature, options, quantize, rnn_reason, stack_members)
    if options.int16:
        if rnn_reason:
            raise FairseqStreamError("--rnn-int16 runs fairseq LSTM models only: {}".format(rnn_reason))
        say_once("fairseq-stream: using the rnn runner (%s; %s)", options.describe(), _int16_kernel_line())
        return rnn.RnnRunner(members, temperature=temperature, options=options)
    # --stack-members on asks for the lean runner as --quantize does: it wins over keeping fairseq's.
    if kind == "fairseq" or (kind == "auto" and keep_fairseq and stack_members is not True):
        if kind == "auto":
            say_once("fairseq-stream: using the fairseq runner (--search fixed --finalize fairseq "
                      "is bitwise fairseq's; --runner lean to change)")
        return ModelRunner(models, temperature=temperature)
    if kind == "rnn" or (kind == "auto" and not rnn_reason):
        if stack_members is True:
            raise FairseqStreamError("--stack-members on runs on our transformer runners (lean, static); these "
                                     "are fairseq LSTM models")
        if rnn_reason:
            say_once("fairseq-stream: --runner rnn: %s; using the fairseq runner", rnn_reason)
            return ModelRunner(models, temperature=temperature)
        say_once("fairseq-stream: using the rnn runner (%s)", options.describe())
        return rnn.RnnRunner(members, temperature=temperature, options=options)
    from fairseq_stream.runners.lean import LeanRunner, unsupported_reason

    reason = next((r for r in map(unsupported_reason, members) if r), None)
    if reason:
        say_once("fairseq-stream: --runner %s: %s; using the fairseq runner", kind, reason)
        return ModelRunner(models, temperature=temperature)
    if kind == "static":
        from fairseq_stream.runners.static_slots import StaticSlotRunner

        runner = StaticSlotRunner(members, temperature=temperature, stack_members=stack_members)
        say_once("fairseq-stream: using the static-slot runner (%s%s)", _members_line(runner), _gemm_line(runner))
        return runner
    runner = LeanRunner(members, temperature=temperature, stack_members=stack_members)
    say_once("fairseq-stream: using the lean runner (%s%s)", _members_line(runner), _gemm_line(runner))
    return runner


def retained_dropout(members) -> str:
    """The first dropout module of ``members`` that fairseq applies while decoding (``--retain-dropout``, with a
    probability above 0), as ``name p=P``; "" where there is none."""
    from fairseq.modules.fairseq_dropout import FairseqDropout

    for member in members:
        for name, module in member.named_modules():
            if isinstance(module, FairseqDropout) and module.apply_during_inference and module.p > 0:
                return "{} p={:g}".format(name, module.p)
    return ""


def _quantized_runner(kind, members, temperature, options, quantize, rnn_reason, stack_members):
    """The runner of ``--quantize``: lean for transformers, rnn's int16 for LSTMs, else a one-line error."""
    import dataclasses

    from fairseq_stream.runners import rnn
    from fairseq_stream.runners.lean import LeanRunner, unsupported_reason

    if kind in ("auto", "rnn") and not rnn_reason:
        if quantize in INT8_KINDS:
            raise FairseqStreamError("--quantize {} is for transformers; fairseq LSTM models take "
                                     "--quantize int16 (Devlin's int16 products)".format(quantize))
        options = dataclasses.replace(options, int16=True)
        say_once("fairseq-stream: using the rnn runner (%s; %s)", options.describe(), _int16_kernel_line())
        return rnn.RnnRunner(members, temperature=temperature, options=options)
    reason = next((r for r in map(unsupported_reason, members) if r), None)
    if kind == "rnn" or reason:
        raise FairseqStreamError("--quantize {} runs fairseq transformers (lean runner) and LSTMs (rnn runner): "
                                 "{}".format(quantize, rnn_reason if kind == "rnn" else reason))
    # int8 is resolved once, here, to the form this CPU runs fastest; the log names the form and the kernel.
    form = quantized_linear.resolve(quantize)
    int8 = form in INT8_KINDS
    onednn = ", oneDNN's for many rows" if int8 and quantized_linear.onednn_exact() else ""
    weights = " ({}-bit weights)".format(quantized_linear.int8_weight_bits(form)) if int8 else ""
    runner = LeanRunner(members, temperature=temperature, quantize=form, stack_members=stack_members)
    say_once("fairseq-stream: using the lean runner (%s, %s products%s: %s kernel%s)", _members_line(runner), form,
             weights, quantized_linear.kernel(form), onednn)
    return runner


def _members_line(runner) -> str:
    """The lean runner's models for the log: how many, and for an ensemble whether they run stacked."""
    count = len(runner.lean)
    if count == 1:
        return "1 model"
    if runner.stacked is not None:
        return "{} models, stacked".format(count)
    return "{} models, one after another: {}".format(count, runner.unstacked_reason)


def _gemm_line(runner) -> str:
    """For the log, where oneDNN's GEMM takes float32 decoder products (ops/product.py): how many of them."""
    names = ("qkv", "self_out", "cross_q", "cross_kv", "cross_out", "fc1", "fc2")
    products = [p for lean in getattr(runner, "lean", []) for p in
                [lean.output] + [getattr(layer, name, None) for layer in lean.layers for name in names]]
    kernels = [getattr(p, "kernel", None) for p in products if getattr(p, "precision", None) == "float32"]
    onednn = kernels.count("onednn")
    if not onednn:
        return ""
    return ", oneDNN's float32 GEMM for {} of {} decoder products, the largest: MKL runs its generic code on a " \
           "CPU that is not Intel's".format(onednn, len(kernels))


def _int16_kernel_line() -> str:
    """Which int16 kernel runs here, for the log (a CPU without AVX2 gets the portable loops)."""
    from fairseq_stream.ops import int16_linear

    kernel = int16_linear.kernel()
    if kernel == "avx512vnni":
        return "AVX-512 VNNI int16 kernel"
    if kernel == "avx2":
        return "AVX2 int16 kernel"
    if kernel == "portable":
        return "portable int16 kernel: this CPU has no AVX2"
    return "int16 in torch: the compiled extension is not built"
