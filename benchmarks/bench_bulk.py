"""Bulk translation, 1 rank against N: throughput, start-up and merge, on a real model.

Runs ``torchrun --standalone --nproc-per-node R -m fairseq_stream.bulk translate``
on the same input for each R in ``--ranks`` (one thread per rank:
``OMP_NUM_THREADS=1``), ``--repeats`` interleaved rounds, each in a fresh work
directory, and reports per R (median over rounds):

* wall clock of the whole command (torchrun's start, imports, model loads,
  translation, the barrier, the merge) and sentences per second over it;
* the translation phase: the slowest rank's time from its model being loaded
  to its last chunk written, and sentences per second over that;
* what the rest costs: start-up inside the job (rendezvous, model load; the
  slowest rank), rank 0's wait at the barrier, the merge, and "other": the
  wall clock minus all of these and the translation phase (torchrun's and
  Python's start, the imports: paid once per command, whatever the input);
* the merged output byte-identical across R (checked), and its BLEU.

The issue's goal is a throughput ratio >= 1.8x for 2 ranks over 1 on the
project's 2-core machine.

    python benchmarks/bench_bulk.py /work/m30k/probe \\
        --inputs /work/shared/data/multi30k/test_2016_flickr.de ... \\
        --refs /work/shared/data/multi30k/test_2016_flickr.en ... [--ranks 1 2] [--repeats 2] [--json FILE]
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import sacrebleu

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
RANK_LINE = re.compile(r"rank (\d+) translated (\d+) chunk\(s\), found (\d+) done; (\d+) sentences in "
                       r"([\d.]+) s after ([\d.]+) s of start-up")
MERGE_LINE = re.compile(r"waited ([\d.]+) s for the other ranks, merged (\d+) lines in ([\d.]+) s")


def concatenate(paths, target):
    with open(target, "w", encoding="utf-8") as out:
        for p in paths:
            with open(p, encoding="utf-8") as f:
                for line in f:
                    out.write(line.rstrip("\n") + "\n")


def one_run(args, ranks, source, work):
    output = os.path.join(work, "out.txt")
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--nproc-per-node",
           str(ranks), "-m", "fairseq_stream.bulk", "translate", "--input", source, "--output", output,
           "--path", os.path.join(args.model_dir, args.checkpoints), "--data",
           os.path.join(args.model_dir, "data-bin"), "--bpe", "sentencepiece", "--sentencepiece-model",
           os.path.join(args.model_dir, "spm", "spm.model"), "--search", args.search, "--beam", str(args.beam),
           "--pool", str(args.pool), "--chunk-size", str(args.chunk_size), "--cpu", "--no-progress-bar"]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit("bulk run failed ({}):\n{}".format(proc.returncode, proc.stderr[-4000:]))
    rows = [tuple(float(x) for x in m.groups()) for m in RANK_LINE.finditer(proc.stderr)]
    merge = [tuple(float(x) for x in m.groups()) for m in MERGE_LINE.finditer(proc.stderr)][0]
    with open(output, "rb") as f:
        data = f.read()
    return {
        "wall_s": wall,
        "sentences": int(sum(r[3] for r in rows)),
        "translate_s": max(r[4] for r in rows),
        "startup_s": max(r[5] for r in rows),
        "chunks_per_rank": [int(r[1]) for r in sorted(rows)],
        "wait_s": merge[0],
        "merge_s": merge[2],
        "output": data,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", help="what scripts/train_multi30k.sh writes (spm/, data-bin/, transformer/)")
    parser.add_argument("--checkpoints", default="transformer/checkpoint_best.pt")
    parser.add_argument("--inputs", nargs="+", required=True, help="source text files, concatenated")
    parser.add_argument("--refs", nargs="+", required=True, help="their references, in the same order")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--search", default="var-stream")
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--pool", type=int, default=64)
    parser.add_argument("--chunk-size", type=int, default=250)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)

    tmp = tempfile.mkdtemp(prefix="bench_bulk.")
    try:
        source, refs_path = os.path.join(tmp, "source.txt"), os.path.join(tmp, "refs.txt")
        concatenate(args.inputs, source)
        concatenate(args.refs, refs_path)
        with open(refs_path, encoding="utf-8") as f:
            refs = f.read().split("\n")[:-1]
        runs = {r: [] for r in args.ranks}
        for repeat in range(args.repeats):
            for r in args.ranks:
                work = os.path.join(tmp, "run{}_{}".format(repeat, r))
                os.makedirs(work)
                runs[r].append(one_run(args, r, source, work))
                shutil.rmtree(work)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    outputs = {run["output"] for rs in runs.values() for run in rs}
    first = runs[args.ranks[0]][0]
    hyps = first["output"].decode("utf-8").split("\n")[:-1]
    bleu = sacrebleu.corpus_bleu(hyps, [refs]).score
    print("bulk translation: {} sentences ({} files), {} k={}, pool {}, chunks of {}, one thread per rank, "
          "median of {} rounds; {}".format(
              len(hyps), len(args.inputs), args.search, args.beam, args.pool, args.chunk_size, args.repeats,
              time.strftime("%Y-%m-%d")))
    print("  {:>5} {:>8} {:>9} {:>11} {:>10} {:>9} {:>7} {:>7} {:>7} {:>14}".format(
        "ranks", "wall s", "sent/s", "translate s", "sent/s tr", "start-up", "wait", "merge", "other",
        "chunks/rank"))
    summary = {}
    for r in args.ranks:
        med = {key: statistics.median(run[key] for run in runs[r])
               for key in ("wall_s", "translate_s", "startup_s", "wait_s", "merge_s")}
        med["other_s"] = statistics.median(
            run["wall_s"] - run["translate_s"] - run["startup_s"] - run["wait_s"] - run["merge_s"] for run in runs[r])
        med["sentences_per_s"] = len(hyps) / med["wall_s"]
        med["translate_sentences_per_s"] = len(hyps) / med["translate_s"]
        med["walls_s"] = [run["wall_s"] for run in runs[r]]
        med["chunks_per_rank"] = [run["chunks_per_rank"] for run in runs[r]]
        summary[r] = med
        print("  {:>5} {:>8.1f} {:>9.1f} {:>11.1f} {:>10.1f} {:>9.1f} {:>7.2f} {:>7.2f} {:>7.1f} {:>14}".format(
            r, med["wall_s"], med["sentences_per_s"], med["translate_s"], med["translate_sentences_per_s"],
            med["startup_s"], med["wait_s"], med["merge_s"], med["other_s"], str(runs[r][0]["chunks_per_rank"])))
    base = args.ranks[0]
    for r in args.ranks[1:]:
        print("  {} ranks / {}: throughput {:.2f}x over the whole command, {:.2f}x over the translation phase "
              "(goal >= 1.8x for 2 ranks)".format(
                  r, base, summary[r]["sentences_per_s"] / summary[base]["sentences_per_s"],
                  summary[r]["translate_sentences_per_s"] / summary[base]["translate_sentences_per_s"]))
    print("  merged outputs byte-identical across runs and rank counts: {}; BLEU {:.2f}".format(
        "yes" if len(outputs) == 1 else "NO ({} different)".format(len(outputs)), bleu))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": sys.argv, "date": time.strftime("%Y-%m-%d"), "sentences": len(hyps),
                       "bleu": bleu, "identical": len(outputs) == 1,
                       "ranks": {str(r): v for r, v in summary.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
