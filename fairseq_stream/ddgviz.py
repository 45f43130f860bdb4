"""DDGviz: the decoding dependency graph of Jacobi decoding, per sentence (Santilli et al. 2023, §4.5).

For each chosen sentence, one picture: iterations down, target positions
across. A cell is filled where, after that iteration, the position holds the
token it ends with (accepted, or guessed right by the window); the first
iteration from which it holds it for good is marked with that token's
probability. Tokens that turn final together in one iteration did not need
each other to be decoded. The JSON beside each PNG holds what the picture
shows (tokens, per iteration the window and its guesses).

    python -m fairseq_stream.ddgviz --path model.pt --data data-bin \\
        --sentencepiece-model spm.model --input test.de --sentences 0 7 --out ddg/ \\
        [--variant pj] [--block 3] [--draft pad]

The default is the paper's: PJ from PAD drafts, the whole sentence refined at
once. Sentences are decoded together (one batch); the picture is the same
whatever the batch holds, as the decoding is.
"""

import argparse
import json
import math
import os
import sys
from typing import Dict, List


def dependency_graph(trace: dict) -> dict:
    """Per position: the first iteration from which it holds its final token, and that token's probability.

    Args:
        trace: a :class:`~fairseq_stream.jacobi.decoder.JacobiDecoder` trace
            (``tokens``: the output; ``iterations``: each iteration's window
            start, width, accepted count, argmax tokens and log-probabilities).

    Returns:
        ``{"tokens", "holds" (iterations x positions, 0/1), "first" (per
        position: iteration), "probability" (per position)}``.
    """
    final = trace["tokens"]
    n = len(final)
    holds = []
    for it in trace["iterations"]:
        start, row = it["start"], []
        verified = start + it["accepted"]  # positions 0 .. verified-1 are accepted after it
        for p in range(n):
            j = p - start  # window position that predicts output position p
            guess = it["tokens"][j] if 0 <= j < len(it["tokens"]) else None
            row.append(1 if p < verified or guess == final[p] else 0)
        holds.append(row)
    first, probability = [], []
    for p in range(n):
        i = len(holds) - 1
        while i > 0 and holds[i - 1][p]:
            i -= 1
        first.append(i)
        # The probability the model gave the final token at that iteration.
        it = trace["iterations"][i]
        j = p - it["start"]
        lp = it["lprobs"][j] if 0 <= j < len(it["lprobs"]) and it["tokens"][j] == final[p] else None
        probability.append(math.exp(lp) if lp is not None else None)
    return {"tokens": final, "holds": holds, "first": first, "probability": probability}


def draw(graph: dict, words: List[str], title: str, path: str):
    """Write the dependency graph as a PNG (matplotlib, no display needed)."""
    import logging

    import matplotlib

    # fairseq's logging setup leaves the root logger at DEBUG: matplotlib's font search would fill the log.
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    holds = graph["holds"]
    iterations, positions = len(holds), len(graph["tokens"])
    fig, ax = plt.subplots(figsize=(max(4.0, 0.55 * positions + 1.5), max(2.5, 0.45 * iterations + 1.5)))
    ax.imshow(holds, cmap="Greens", vmin=0, vmax=2.5, aspect="auto", interpolation="nearest")
    for p, (i, prob) in enumerate(zip(graph["first"], graph["probability"])):
        ax.add_patch(matplotlib.patches.Rectangle((p - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="black", lw=1.2))
        if prob is not None:
            ax.text(p, i, "{:.2f}".format(prob), ha="center", va="center", fontsize=7)
    ax.set_xticks(range(positions))
    ax.set_xticklabels(words, rotation=60, ha="right", fontsize=8)
    ax.set_yticks(range(iterations))
    ax.set_yticklabels([str(i + 1) for i in range(iterations)], fontsize=8)
    ax.set_xlabel("target position (final token)")
    ax.set_ylabel("iteration")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _checked_input(args):
    """The input's lines, everything checked before the models load (missing files, bad text and a bad --out
    were tracebacks); :class:`FairseqStreamError` names what is wrong."""
    from fairseq_stream.errors import FairseqStreamError
    from fairseq_stream.text_input import read_lines

    if args.block < 1:
        raise FairseqStreamError("--block must be at least 1, got {}".format(args.block))
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise FairseqStreamError("--out {} is a file, not a directory".format(args.out))
    if args.sentencepiece_model and not os.path.isfile(args.sentencepiece_model):
        raise FairseqStreamError("--sentencepiece-model {}: no such file".format(args.sentencepiece_model))
    lines = list(read_lines(args.input))
    bad = [i for i in args.sentences if not 0 <= i < len(lines)]
    if bad:
        raise FairseqStreamError("--sentences {}: {} has {} lines".format(bad, args.input, len(lines)))
    empty = [i for i in args.sentences if not lines[i].strip()]
    if empty:  # an empty sentence is translated without a decode: there is no graph to draw
        raise FairseqStreamError("--sentences {}: empty line(s) of {}, nothing to decode".format(empty, args.input))
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m fairseq_stream.ddgviz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", required=True, help="checkpoint(s), colon-separated (an ensemble)")
    parser.add_argument("--data", help="the data-bin directory with the dictionaries (default: the checkpoint's)")
    parser.add_argument("--input", required=True, help="source text, one sentence per line")
    parser.add_argument("--sentences", type=int, nargs="+", required=True, help="line numbers (from 0) to draw")
    parser.add_argument("--out", required=True, help="directory for <line>.png and <line>.json")
    # The paper's figures draw PJ from padded drafts: every token's dependencies show (the decoder's own
    # default, hgj with n-gram drafts, is the fastest, and draws fewer iterations).
    parser.add_argument("--variant", default="pj", choices=("pj", "pgj", "hgj"), help="default: %(default)s")
    parser.add_argument("--block", type=int, default=3, help="pgj and hgj's block (default: %(default)s)")
    parser.add_argument("--draft", default="pad", choices=("pad", "ngram"), help="default: %(default)s")
    parser.add_argument("--sentencepiece-model", help="the source/target SentencePiece model")
    parser.add_argument("--bpe", help="fairseq --bpe (default: sentencepiece with --sentencepiece-model)")
    parser.add_argument("--cpu", action="store_true")
    args = parser.parse_args(argv)
    import logging

    # fairseq's logging setup leaves the root logger at DEBUG: matplotlib's font search would fill the log.
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    from fairseq_stream.api import Translator
    from fairseq_stream.errors import FairseqStreamError
    from fairseq_stream.jacobi.decoder import JacobiUnsupported

    try:
        lines = _checked_input(args)
        bpe = args.bpe or ("sentencepiece" if args.sentencepiece_model else None)
        translator = Translator(args.path.split(":"), data=args.data, search="jacobi", bpe=bpe,
                                sentencepiece_model=args.sentencepiece_model, cpu=args.cpu,
                                jacobi_variant=args.variant, jacobi_block=args.block, jacobi_draft=args.draft)
        chosen = sorted(set(args.sentences))
        decoder = translator.decoder
        # Inputs are numbered by their place in the list given to translate().
        decoder.trace_ids = set(range(len(chosen)))
        results = {t.index: t for t in translator.translate([lines[i] for i in chosen])}
    except JacobiUnsupported as e:
        # DDGviz has no --search: fairseq-generate's advice to use greedy means nothing here.
        sys.exit("fairseq-stream: error: DDGviz draws Jacobi decoding, which {}".format(e.reason))
    except FairseqStreamError as e:
        sys.exit("fairseq-stream: error: {}".format(e))
    os.makedirs(args.out, exist_ok=True)
    d = translator.task.target_dictionary
    for k, line in enumerate(chosen):
        trace = decoder.traces[k]
        graph = dependency_graph(trace)
        words = [d[t] for t in graph["tokens"]]
        iterations = len(trace["iterations"])
        setting = args.variant if args.variant == "pj" else "{} b={}".format(args.variant, args.block)
        title = "{} draft={}: {} tokens in {} iterations\n{}".format(
            setting, args.draft, len(words), iterations, results[k].text)
        base = os.path.join(args.out, str(line))
        draw(graph, words, title, base + ".png")
        with open(base + ".json", "w", encoding="utf-8") as f:
            json.dump(dict(graph, line=line, source=lines[line], translation=results[k].text, words=words,
                           variant=args.variant, block=args.block, draft=args.draft,
                           iterations=trace["iterations"]), f, ensure_ascii=False, indent=1)
        print("{}: {} tokens, {} iterations -> {}.png".format(line, len(words), iterations, base))


if __name__ == "__main__":
    main()
