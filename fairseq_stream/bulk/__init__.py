"""Bulk translation across processes, GPUs and machines on torch.distributed: sharded, resumable, merged in order.

    torchrun --nproc-per-node 4 -m fairseq_stream.bulk translate \\
        --input corpus.de --output corpus.en --path m1.pt:m2.pt --data data-bin \\
        --bpe sentencepiece --sentencepiece-model spm.model --search var-stream --beam 5

    fairseq-stream-bulk translate ...        # one process, no torchrun
    fairseq-stream-bulk merge --input corpus.de --output corpus.en ...   # merge again, another --format

The input is cut into chunks of ``--chunk-size`` lines; ranks take the next
free chunk from a counter in the torch.distributed store, so faster ranks
take more. Each finished chunk is written atomically with a manifest (input
hash, settings hash, output hash) under ``--work-dir`` (default:
``OUTPUT.chunks``); a re-run of the same command skips finished chunks and
redoes missing, partial, corrupt or stale ones. Rank 0 shows the progress of
the whole job and, at the end, merges the chunks into ``--output`` in input
order. Every input line gets exactly one output line (an empty line an empty
translation; with ``--long-lines skip`` an over-long line an empty one too).
A regular ``--output`` file is replaced atomically (a read-only one, or a
symbolic link to nothing, is refused); a device, fifo or pipe
(``/dev/null``, ``/dev/fd/N``) is written into, never replaced. Ctrl-C ends a
run with one line and exit status 130; the same command resumes it. Under
torchrun, a rank exits when its launcher does (see :mod:`.launcher`).
"""

import argparse
import logging
import sys

from fairseq_stream.errors import FairseqStreamError, install_excepthook


def parser() -> argparse.ArgumentParser:
    """The command line of ``fairseq-stream-bulk`` (``translate`` and ``merge``)."""
    p = argparse.ArgumentParser(prog="fairseq-stream-bulk", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_text in (("translate", "translate the input (run under torchrun for several ranks)"),
                            ("merge", "merge finished chunks into --output again (e.g. in another --format)")):
        c = sub.add_parser(name, help=help_text)
        c.add_argument("--input", required=True, help="plain text, one sentence per line")
        c.add_argument("--output", required=True, help="where the merged translations go (a regular file is "
                       "replaced; a read-only one or a symbolic link to nothing is refused)")
        c.add_argument("--work-dir", help="chunk outputs and manifests (default: OUTPUT.chunks); shared by all "
                       "ranks: on several machines, a shared file system")
        c.add_argument("--chunk-size", type=int, default=10000, help="input lines per chunk (default 10000)")
        c.add_argument("--format", choices=["text", "scores", "generate"], default="text",
                       help="text: one translation per line; scores: score<TAB>translation (the score in natural "
                       "log, as the Python API gives it); generate: fairseq-generate's S-/H- lines (H: the score "
                       "in base 2 as fairseq-generate prints it, and the detokenized translation)")
        c.add_argument("--path", required=True, help="checkpoint(s), colon-separated for an ensemble")
        c.add_argument("--data", help="data-bin directory with the dictionaries (default: the checkpoint's)")
        c.add_argument("--search", default="var-stream", help="var-stream (default), var, var-batch, fixed, greedy, jacobi")
        c.add_argument("--beam", type=int, default=5)
        c.add_argument("--bpe")
        c.add_argument("--tokenizer")
        c.add_argument("--sentencepiece-model")
        c.add_argument("--bpe-codes")
        c.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                       help="a search or generation option by its name, e.g. lenpen=1.2, prune_ap=2.0 (repeat); "
                       "nbest=N (N > 1) needs --format generate")
        if name == "translate":
            c.add_argument("--pool", type=int, default=64, help="sentences decoded at once per rank")
            c.add_argument("--batch-size", type=int, help="sentences encoded together (default: --pool)")
            c.add_argument("--maxi-batch", type=int, default=1,
                           help="sort each window of this many batches by length before decoding (Marian's "
                           "maxi-batch; default 1: input order)")
            c.add_argument("--cpu", action="store_true", help="do not use CUDA even if available")
            c.add_argument("--trust-checkpoint", action="store_true",
                           help="load the checkpoints with the full unpickler (trusted files only)")
            c.add_argument("--no-progress-bar", action="store_true")
            c.add_argument("--long-lines", choices=["error", "skip", "truncate"], default="error",
                           help="a line longer than the model's positions: error (default: stop, naming its "
                           "line), skip (an empty output line) or truncate (translate the longest prefix of "
                           "whole words that fits); the summary counts them")
            c.add_argument("--startup-timeout", type=float, default=600, metavar="SECONDS",
                           help="how long a rank waits at start-up for the job's store and rank 0's input "
                           "index (default 600)")
    return p


INTERRUPTED = "fairseq-stream-bulk: interrupted; rerun the same command to resume"


def main(argv=None):
    """The ``fairseq-stream-bulk`` command; Ctrl-C ends it with one line and exit status 130."""
    from fairseq_stream.bulk.launcher import die_with_launcher

    die_with_launcher()  # first: a rank must not outlive a torchrun that is killed during start-up
    install_excepthook()
    try:
        _main(argv)
        return
    except KeyboardInterrupt:
        pass  # leaving the except block frees the traceback: the translation's generators close
    # The threads have stopped (the progress bar's in a finally block, the encoder's as its generator
    # closes, or at exit) and every finished chunk is on disk, where a rerun finds it.
    print(INTERRUPTED, file=sys.stderr)
    sys.exit(130)


def _main(argv):
    args = parser().parse_args(argv)
    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s", level=logging.INFO,
                        stream=sys.stderr)
    from datetime import timedelta

    from fairseq_stream.bulk import chunks, job, options

    if args.beam < 1:  # before nbest's check, which would name --option nbest for it
        raise FairseqStreamError("--beam must be at least 1, got {}".format(args.beam))
    if "" in args.path.split(":"):
        raise FairseqStreamError("--path {!r}: an empty checkpoint name (an ensemble is a.pt:b.pt)".format(args.path))
    option_values = options.checked(args.search, args.option)
    options.check_nbest(option_values, args.format, args.beam)
    work_dir = args.work_dir or default_work_dir(args.output)
    settings = job.JobSettings(
        paths=args.path.split(":"), search=args.search, beam=args.beam, data=args.data, bpe=args.bpe,
        tokenizer=args.tokenizer, sentencepiece_model=args.sentencepiece_model, bpe_codes=args.bpe_codes,
        options=option_values)
    if args.command == "merge":
        index = chunks.index_input(args.input, args.chunk_size)
        summary = chunks.merge(index, work_dir, settings.digest(), args.output, args.format)
        print("fairseq-stream bulk: merged {} lines into {}{}".format(
            index.lines, args.output, _long_lines_note(summary)), file=sys.stderr)
        return
    if not args.startup_timeout > 0:
        raise FairseqStreamError("--startup-timeout must be more than 0 seconds, got {}".format(args.startup_timeout))
    summary = job.run(args.input, args.output, work_dir, args.chunk_size, settings, fmt=args.format,
                      pool=args.pool, batch_size=args.batch_size, maxi_batch=args.maxi_batch, cpu=args.cpu,
                      trust_checkpoint=args.trust_checkpoint, progress=not args.no_progress_bar,
                      long_lines=args.long_lines, startup_timeout=timedelta(seconds=args.startup_timeout))
    if summary is not None:
        print("fairseq-stream bulk: wrote {}{}".format(args.output, _long_lines_note(summary)), file=sys.stderr)


def default_work_dir(output: str) -> str:
    """``OUTPUT.chunks``; refused where ``output`` is a device, fifo or pipe (it would land in /dev or /proc)."""
    from fairseq_stream.bulk.chunks import output_target

    target = output_target(output)
    if target.streamed:
        raise FairseqStreamError(
            "--output {} is a {} (written into, never replaced): give --work-dir for the chunk files, which "
            "by default go next to the output".format(output, target.kind))
    return output + ".chunks"


def _long_lines_note(summary: dict) -> str:
    counts = summary.get("long_lines") or {}
    words = {"skip": "skipped (empty output lines)", "truncate": "truncated"}
    return "".join("; {} over-long line{} {}".format(n, "" if n == 1 else "s", words.get(mode, mode))
                   for mode, n in sorted(counts.items()))


__all__ = ["main", "parser", "FairseqStreamError", "INTERRUPTED"]
