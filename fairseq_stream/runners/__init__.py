"""Model runners behind one interface (``start / step / step_mixed / reorder / take / concat``).

* ``fairseq``: :class:`fairseq_stream.runner.ModelRunner`, fairseq's own
  ``EnsembleModel`` calls; the reference every other runner is tested against.
* ``lean``: :class:`fairseq_stream.runners.lean.LeanRunner`, our own
  incremental step for fairseq transformers (preallocated caches, encoder keys
  shared by a sentence's rows, fused projections).

``auto`` takes ``lean`` where every model of the ensemble is supported and
``fairseq`` otherwise, and says which once in the log.
"""

import logging

from fairseq_stream.errors import FairseqStreamError

logger = logging.getLogger(__name__)

RUNNERS = ("auto", "fairseq", "lean")
_said = set()


def say_once(message, *args):
    """Log ``message % args`` at INFO, once per process (decoders are built per batch by some callers)."""
    key = message % args
    if key not in _said:
        _said.add(key)
        logger.info(message, *args)


def build_runner(kind: str, models, temperature: float = 1.0, keep_fairseq: bool = False):
    """The runner ``kind`` for ``models``.

    Args:
        kind: ``auto``, ``fairseq`` or ``lean``.
        keep_fairseq: ``auto`` keeps the fairseq runner (``--search fixed
            --finalize fairseq``, whose promise is bitwise identity with
            fairseq's SequenceGenerator).
    """
    from fairseq_stream.runner import ModelRunner

    if kind not in RUNNERS:
        raise FairseqStreamError("--runner must be one of {}, got {}".format(", ".join(RUNNERS), kind))
    if kind == "fairseq" or (kind == "auto" and keep_fairseq):
        if kind == "auto":
            say_once("fairseq-stream: using the fairseq runner (--search fixed --finalize fairseq "
                      "is bitwise fairseq's; --runner lean to change)")
        return ModelRunner(models, temperature=temperature)
    from fairseq_stream.runners.lean import LeanRunner, unsupported_reason

    members = getattr(models, "models", models)
    reason = next((r for r in map(unsupported_reason, members) if r), None)
    if reason:
        say_once("fairseq-stream: --runner %s: %s; using the fairseq runner", kind, reason)
        return ModelRunner(models, temperature=temperature)
    say_once("fairseq-stream: using the lean runner (%d model%s)", len(members),
              "" if len(members) == 1 else "s")
    return LeanRunner(members, temperature=temperature)
