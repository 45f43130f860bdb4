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
translation).
"""

import argparse
import ast
import logging
import os
import sys

from fairseq_stream.errors import FairseqStreamError, install_excepthook


def _option(text: str):
    """``KEY=VALUE`` of ``--option``: the value as a Python literal where it is one (1, 0.5, True), else text."""
    if "=" not in text:
        raise argparse.ArgumentTypeError("--option takes KEY=VALUE, got {!r}".format(text))
    key, value = text.split("=", 1)
    try:
        value = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        pass
    return key.strip().replace("-", "_"), value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fairseq-stream-bulk", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_text in (("translate", "translate the input (run under torchrun for several ranks)"),
                            ("merge", "merge finished chunks into --output again (e.g. in another --format)")):
        c = sub.add_parser(name, help=help_text)
        c.add_argument("--input", required=True, help="plain text, one sentence per line")
        c.add_argument("--output", required=True, help="where the merged translations go")
        c.add_argument("--work-dir", help="chunk outputs and manifests (default: OUTPUT.chunks); shared by all "
                       "ranks: on several machines, a shared file system")
        c.add_argument("--chunk-size", type=int, default=10000, help="input lines per chunk (default 10000)")
        c.add_argument("--format", choices=["text", "scores", "generate"], default="text",
                       help="text: one translation per line; scores: score<TAB>translation; generate: "
                       "fairseq-generate's S-/H- lines (H: score and detokenized translation)")
        c.add_argument("--path", required=True, help="checkpoint(s), colon-separated for an ensemble")
        c.add_argument("--data", help="data-bin directory with the dictionaries (default: the checkpoint's)")
        c.add_argument("--search", default="var-stream", help="var-stream (default), var, var-batch, fixed, greedy")
        c.add_argument("--beam", type=int, default=5)
        c.add_argument("--bpe")
        c.add_argument("--tokenizer")
        c.add_argument("--sentencepiece-model")
        c.add_argument("--bpe-codes")
        c.add_argument("--option", type=_option, action="append", default=[], metavar="KEY=VALUE",
                       help="a search or generation option by its name, e.g. lenpen=1.2, prune_ap=2.0 (repeat)")
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
    return p


def main(argv=None):
    """The ``fairseq-stream-bulk`` command."""
    install_excepthook()
    args = parser().parse_args(argv)
    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s", level=logging.INFO,
                        stream=sys.stderr)
    from fairseq_stream.bulk import chunks, job

    work_dir = args.work_dir or args.output + ".chunks"
    settings = job.JobSettings(
        paths=args.path.split(":"), search=args.search, beam=args.beam, data=args.data, bpe=args.bpe,
        tokenizer=args.tokenizer, sentencepiece_model=args.sentencepiece_model, bpe_codes=args.bpe_codes,
        options=dict(args.option))
    if args.command == "merge":
        index = chunks.index_input(args.input, args.chunk_size)
        chunks.merge(index, work_dir, settings.digest(), args.output, args.format)
        print("fairseq-stream bulk: merged {} lines into {}".format(index.lines, args.output), file=sys.stderr)
        return
    out = job.run(args.input, args.output, work_dir, args.chunk_size, settings, fmt=args.format, pool=args.pool,
                  batch_size=args.batch_size, maxi_batch=args.maxi_batch, cpu=args.cpu,
                  trust_checkpoint=args.trust_checkpoint,
                  progress=not args.no_progress_bar)
    if out is not None:
        print("fairseq-stream bulk: wrote {}".format(out), file=sys.stderr)


__all__ = ["main", "parser", "FairseqStreamError"]
