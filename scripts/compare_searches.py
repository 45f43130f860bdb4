#!/usr/bin/env python3
"""Decode the same toy input with fairseq's beam search, var-stream and greedy.

The quickstart's closing step. It runs the real ``fairseq-generate`` with
``--user-dir fairseq_stream`` once per search and round, on the CPU with one
thread, and prints a short table from fairseq's own output lines:

* BLEU from its sacreBLEU line (``--scoring sacrebleu``):
  ``Generate valid with beam=5: BLEU = 46.05 ...``
* seconds from its ``Translated N sentences (T tokens) in X s (R sentences/s,
  ...)`` line: decoding time only (fairseq's timer around each batch's
  generation), not start-up or model loading. fairseq rounds X to 0.1 s, so
  the seconds are taken as N / R, which carries more digits.

    python scripts/compare_searches.py [TOY_DIR] [--runs 3] [--batch-size 64]

TOY_DIR is what ``scripts/train_toy.sh`` writes (default: toy). Each search's
full fairseq output (last round) is kept in TOY_DIR/compare/SEARCH.log. If a
run fails, its command and the tail of its output are printed and the script
exits non-zero.
"""

import argparse
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The valid set (200 sentences), not the test set (37): on this toy model the
# test set decodes in under a second, close to the 0.1 s steps fairseq prints
# and to the noise of a shared machine; 200 sentences take 1-2 s per search
# and give steadier ratios for about 1 s more per run.
SUBSET = "valid"

# (label, search options). --beam 5 for both beam searches; greedy ignores it.
SEARCHES = [
    ("beam", ["--search", "beam", "--beam", "5"]),
    ("var-stream", ["--search", "var-stream", "--beam", "5"]),
    ("greedy", ["--search", "greedy"]),
]

BLEU_RE = re.compile(r"^Generate \S+ with beam=\d+: BLEU = ([0-9.]+)", re.M)
TRANSLATED_RE = re.compile(
    r"Translated ([0-9,]+) sentences \(([0-9,]+) tokens\) in ([0-9.]+)s "
    r"\(([0-9.]+) sentences/s"
)
PAIR_RE = re.compile(r"^([SH])-(\d+)\t(.*)$", re.M)

# fairseq-generate's own output (its INFO log, every S-/H- line) goes to TOY/compare/SEARCH.log only;
# --verbose or FAIRSEQ_STREAM_VERBOSE=1 also prints it, on stderr.
VERBOSE = os.environ.get("FAIRSEQ_STREAM_VERBOSE", "") not in ("", "0")


def fairseq_generate():
    """The fairseq-generate next to this Python (the venv's), else from PATH."""
    local = os.path.join(os.path.dirname(sys.executable), "fairseq-generate")
    return local if os.path.exists(local) else "fairseq-generate"


def run(toy, label, options, batch_size, env):
    cmd = [
        fairseq_generate(),
        os.path.join(toy, "data-bin"),
        "--path", os.path.join(toy, "transformer", "checkpoint_best.pt"),
        "--user-dir", "fairseq_stream",
        *options,
        "--gen-subset", SUBSET,
        "--batch-size", str(batch_size),
        "--scoring", "sacrebleu",
        "--cpu",
        "--log-format", "simple",
    ]
    proc = subprocess.run(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )
    out = proc.stdout
    os.makedirs(os.path.join(toy, "compare"), exist_ok=True)
    log = os.path.join(toy, "compare", label + ".log")
    with open(log, "w") as f:
        f.write(out)
    if VERBOSE:
        sys.stderr.write("---- fairseq-generate --search {} ----\n{}".format(label, out))
    bleu = BLEU_RE.search(out)
    translated = TRANSLATED_RE.search(out)
    if proc.returncode != 0 or not bleu or not translated:
        # The tail, or from the last traceback on; fairseq's one-line config
        # dump is thousands of characters, so long lines are cut.
        lines = out.rstrip("\n").split("\n")
        starts = [i for i, line in enumerate(lines) if line.startswith("Traceback")]
        lines = lines[starts[-1]:] if starts else lines[-15:]
        tail = "\n".join(line if len(line) <= 300 else line[:300] + " [...]" for line in lines[-40:])
        why = ("exit status {}".format(proc.returncode) if proc.returncode != 0
               else "no sacreBLEU or 'Translated' line in its output")
        sys.stderr.write(
            "fairseq-stream: --search {} failed ({}):\n  {}\n---- end of its output (all of it: {}) ----\n{}\n"
            .format(label, why, " ".join(cmd), log, tail)
        )
        sys.exit(1)
    sentences = int(translated.group(1).replace(",", ""))
    per_second = float(translated.group(4))
    seconds = sentences / per_second if per_second > 0 else float(translated.group(3))
    pairs = {}
    for kind, idx, text in PAIR_RE.findall(out):
        if kind == "H":
            text = text.split("\t", 1)[-1]  # drop the score column
        pairs.setdefault(int(idx), {})[kind] = text
    return {"bleu": float(bleu.group(1)), "seconds": seconds,
            "sentences": sentences, "pairs": pairs}


# Rounds of one search further apart than this: the machine was busy, and
# even the fastest round may carry some of it.
NOISY_SPREAD = 1.5


def warn_if_noisy(rounds):
    """Say so where one search's rounds differ by more than NOISY_SPREAD (a busy machine)."""
    noisy = {label: times for label, times in rounds.items() if max(times) > NOISY_SPREAD * min(times)}
    if noisy:
        print("  note: the machine was busy (rounds of {}); the fastest counts, and more rounds "
              "(--runs 5) steady it".format("; ".join(
                  "{} {:.2f}-{:.2f} s".format(label, min(t), max(t)) for label, t in noisy.items())))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("toy", nargs="?", default="toy", help="toy directory (default: toy)")
    parser.add_argument("--runs", type=int, default=3,
                        help="rounds of the three searches; the fastest round of each counts (default 3)")
    parser.add_argument("--batch-size", type=int, default=64,
                        help="fairseq's --batch-size, also var-stream's pool size (default 64)")
    parser.add_argument("--examples", type=int, default=2,
                        help="source/hypothesis pairs to show (default 2)")
    parser.add_argument("--verbose", action="store_true",
                        help="also print fairseq-generate's own output (default: only in TOY/compare/*.log;"
                             " FAIRSEQ_STREAM_VERBOSE=1 does the same)")
    args = parser.parse_args()
    for flag, value, least in (("--runs", args.runs, 1), ("--batch-size", args.batch_size, 1),
                               ("--examples", args.examples, 0)):
        if value < least:
            parser.error("{} must be at least {}, got {}".format(flag, least, value))
    global VERBOSE
    VERBOSE = VERBOSE or args.verbose
    toy = os.path.abspath(args.toy)
    # Checked before anything is written there: a mistyped TOY_DIR got a compare/ folder, then a traceback.
    for needed in ("data-bin", os.path.join("transformer", "checkpoint_best.pt"), os.path.join("raw", "valid.src")):
        if not os.path.exists(os.path.join(toy, needed)):
            parser.error("{} is not a toy directory: no {} in it (scripts/train_toy.sh or "
                         "python scripts/toy_cache.py --copy-to DIR makes one)".format(args.toy, needed))

    env = dict(os.environ)
    # One thread for every run: comparable timings on a shared machine (and
    # what the project's CPU benchmarks use).
    env["OMP_NUM_THREADS"] = "1"
    env["MKL_NUM_THREADS"] = "1"

    best, rounds = {}, {}
    # Rounds interleave the searches, so a burst of load elsewhere hits all of
    # them alike; the minimum drops what such bursts add.
    for _ in range(args.runs):
        for label, options in SEARCHES:
            result = run(toy, label, options, args.batch_size, env)
            rounds.setdefault(label, []).append(result["seconds"])
            if label in best:
                if result["bleu"] != best[label]["bleu"]:
                    sys.stderr.write("fairseq-stream: warning: --search {} gave BLEU {} and {} "
                                     "in two runs\n".format(label, best[label]["bleu"], result["bleu"]))
                if result["seconds"] >= best[label]["seconds"]:
                    continue
            best[label] = result

    beam = best["beam"]
    n = beam["sentences"]
    src = os.path.relpath(os.path.join(toy, "raw", SUBSET + ".src"), REPO)
    print("fairseq-stream: {} ({} sentences), fairseq-generate --cpu --batch-size {},"
          " one thread (OMP_NUM_THREADS=1)".format(src, n, args.batch_size))
    print("  {:<11} {:>4} {:>6} {:>8} {:>16}".format("--search", "beam", "BLEU", "seconds", "speedup vs beam"))
    for label, options in SEARCHES:
        r = best[label]
        width = options[options.index("--beam") + 1] if "--beam" in options else "1"
        print("  {:<11} {:>4} {:>6.2f} {:>8.2f} {:>15.2f}x".format(
            label, width, r["bleu"], r["seconds"], beam["seconds"] / r["seconds"]))
    print("  seconds: decoding only (fairseq's 'Translated {} sentences' line), fastest of {} runs;"
          " BLEU: fairseq's sacreBLEU line".format(n, max(1, args.runs)))
    warn_if_noisy(rounds)
    pairs = best["var-stream"]["pairs"]
    shown = [i for i in sorted(pairs) if "S" in pairs[i] and "H" in pairs[i]][: args.examples]
    if shown:
        print("  example translations (var-stream; full outputs in {}/):".format(
            os.path.relpath(os.path.join(toy, "compare"), REPO)))
        for i in shown:
            print("    S-{}  {}".format(i, pairs[i]["S"]))
            print("    H-{}  {}".format(i, pairs[i]["H"]))


if __name__ == "__main__":
    main()
