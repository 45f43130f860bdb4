"""Errors that fairseq-stream reports to users as one line, not as a traceback."""

import os
import sys


class FairseqStreamError(RuntimeError):
    """A user-facing error: bad option, bad input or a refused checkpoint.

    The command-line tools print these as ``fairseq-stream: error: <message>``
    and exit with status 1 instead of showing a traceback from inside fairseq.
    """


class CheckpointError(FairseqStreamError):
    """A checkpoint file is missing, unreadable, or not a fairseq checkpoint."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint holds a pickled global that fairseq checkpoints never need."""


# fairseq's SequenceGenerator asserts this per batch (sequence_generator.py, _generate).
FAIRSEQ_MIN_LEN = "min_len cannot be larger than max_len"
# What our searches (lengths.max_lengths) and the hook below say of it: a batch whose maximum length
# (--max-len-a times its source plus --max-len-b) is below --min-len.
MIN_LEN_ABOVE_MAX = "--min-len is larger than the maximum length of a batch; adjust --max-len-a/-b"


def install_excepthook():
    """Print uncaught :class:`FairseqStreamError` as one line, and in a fairseq tool an uncaught Ctrl-C
    (before our handler of :mod:`fairseq_stream.interrupt` is set: while fairseq loads the data and the
    models); leave others alone. Python still ends with status 130 after a KeyboardInterrupt."""
    previous = sys.excepthook
    if getattr(previous, "_fairseq_stream", False):
        return

    def hook(exc_type, exc, tb):
        from fairseq_stream import interrupt

        if issubclass(exc_type, FairseqStreamError):
            sys.stderr.write("fairseq-stream: error: {}\n".format(exc))
            sys.stderr.flush()
            return
        if issubclass(exc_type, KeyboardInterrupt) and interrupt.in_fairseq_tool():
            sys.stderr.write(interrupt.INTERRUPTED + "\n")
            sys.stderr.flush()
            return
        if issubclass(exc_type, BrokenPipeError) and interrupt.in_fairseq_tool():
            # The reader of the output is gone (`fairseq-interactive ... | head`): nothing to say to it, and
            # the exit's flush of the output would fail again (Python's documented way out, SIGPIPE's).
            _stdout_to_devnull()
            return
        if issubclass(exc_type, AssertionError) and interrupt.in_fairseq_tool() and FAIRSEQ_MIN_LEN in str(exc):
            # --search beam's SequenceGenerator checks each batch; ours say it so (lengths.max_lengths). A
            # maximum that does not grow with the source is refused before any output (plugin.common).
            sys.stderr.write("fairseq-stream: error: {}\n".format(MIN_LEN_ABOVE_MAX))
            sys.stderr.flush()
            return
        if issubclass(exc_type, OSError) and interrupt.in_fairseq_tool():
            # A full disk, /dev/full, a --results-path that cannot be made: the system's words and the file
            # say what is wrong; fairseq's frames do not.
            sys.stderr.write("fairseq-stream: error: {}\n".format(exc))
            sys.stderr.flush()
            _drop_unwritable_stdout()
            return
        previous(exc_type, exc, tb)

    hook._fairseq_stream = True
    sys.excepthook = hook


def _drop_unwritable_stdout():
    """Where standard output cannot take what is buffered for it (the disk the error was about), point it
    at /dev/null: the exit's flush would fail again, as an "Exception ignored" traceback."""
    try:
        sys.stdout.flush()
    except OSError:
        _stdout_to_devnull()


def _stdout_to_devnull():
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
