"""Decoding on 1 and 2 threads, with both cores free and with one held by a busy process (issue 50).

For each tree (a checkout of this repository with its kernels built: the
state before a change and after it), precision and search, runs the real
``fairseq-generate --user-dir TREE/fairseq_stream --cpu`` with
``OMP_NUM_THREADS`` 1 and 2, and again while another process spins on one
core, and reads the decoding seconds from fairseq's ``Translated N
sentences ... (R sentences/s`` line (N / R). Rounds interleave the runs;
the fastest of each counts. Every run's translations must equal the
one-thread run's of the same tree (the threads change when work is done,
never what is produced), or the script stops.

    python benchmarks/bench_threads.py DATA_BIN CHECKPOINT --trees before=/path after=. \\
        [--subset valid] [--batch-size 64] [--rounds 3] [--searches 'fixed k=5' 'var-stream k=5'] \\
        [--options '--cpu-workers 1 -s de -t en'] [--json out.json]

``--options`` adds fairseq-generate options to every run: ``--cpu-workers 1``
keeps one process, so that the second thread is our kernels' (intra-op)
rather than a second worker's; a stand-in's data-bin needs ``-s de -t en``.

Results: a table of seconds and of each run's time over the same tree's one
thread, with the CPU's model and SIMD level.
"""

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time

import preamble  # noqa: F401  (first: paths)
from busy_core import busy_core

TRANSLATED = re.compile(r"Translated ([\d,]+) sentences \(([\d,]+) tokens\) in ([\d.]+)s \(([\d.]+) sentences/s")
SEARCHES = {"greedy": ["--search", "greedy"], "fixed k=5": ["--search", "fixed", "--beam", "5", "--runner", "lean"],
            "var-batch k=5": ["--search", "var-batch", "--beam", "5"],
            "var-stream k=5": ["--search", "var-stream", "--beam", "5"]}
PRECISIONS = {"float32": [], "int8": ["--quantize", "int8"]}
LAYOUTS = [("1 thread", "1", False), ("2 threads", "2", False), ("1 thread, busy core", "1", True),
           ("2 threads, busy core", "2", True)]


def cpu_model() -> str:
    """The CPU's model name and its widest SIMD level (from /proc/cpuinfo)."""
    info = open("/proc/cpuinfo").read()
    model = re.search(r"model name\s*:\s*(.*)", info)
    flags = set(re.search(r"flags\s*:\s*(.*)", info).group(1).split())
    simd = "AVX-512 VNNI" if "avx512_vnni" in flags else "AVX-512" if "avx512f" in flags else \
        "AVX2" if "avx2" in flags else "SSE"
    return "{} ({}, {} cores usable)".format(model.group(1).strip() if model else "?", simd,
                                             len(os.sched_getaffinity(0)))


def decode(tree, args, options, threads):
    """(decoding seconds, hypotheses) of one fairseq-generate run of ``tree``."""
    env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, PYTHONPATH=tree)
    argv = ["fairseq-generate", args.data_bin, "--path", args.checkpoint, "--user-dir",
            os.path.join(tree, "fairseq_stream"), "--gen-subset", args.subset, "--batch-size",
            str(args.batch_size), "--cpu"] + options + shlex.split(args.options)
    proc = subprocess.run(argv, env=env, capture_output=True, text=True)
    found = TRANSLATED.search(proc.stderr + proc.stdout)
    if proc.returncode != 0 or not found:
        sys.exit("bench_threads: {} failed ({}):\n{}".format(" ".join(argv), proc.returncode, proc.stderr[-3000:]))
    hyps = sorted(line for line in proc.stdout.splitlines() if line.startswith("H-"))
    return int(found.group(1).replace(",", "")) / float(found.group(4)), hyps


def run_all(args):
    trees = dict(t.split("=", 1) for t in args.trees)
    best = {}
    for _ in range(args.rounds):
        for (tree, root), (precision, p_opts), (search, s_opts), (layout, threads, busy) in (
                (t, p, s, l) for t in trees.items() for p in PRECISIONS.items() for s in SEARCHES.items()
                for l in LAYOUTS):
            if precision not in args.precisions or search not in args.searches:
                continue
            with busy_core(busy):
                seconds, hyps = decode(os.path.abspath(root), args, s_opts + p_opts, threads)
            key = (tree, precision, search, layout)
            reference = best.get((tree, precision, search, "1 thread"))
            if reference is not None and hyps != reference["hyps"]:
                sys.exit("bench_threads: {} gave other translations than one thread".format(key))
            if key not in best or seconds < best[key]["seconds"]:
                best[key] = {"seconds": seconds, "hyps": hyps}
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data_bin")
    parser.add_argument("checkpoint")
    parser.add_argument("--trees", nargs="+", default=["this=" + preamble.REPO],
                        help="LABEL=PATH checkouts with their kernels built (default: this one)")
    parser.add_argument("--subset", default="valid")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS))
    parser.add_argument("--searches", nargs="+", default=["greedy", "fixed k=5", "var-batch k=5"],
                        choices=list(SEARCHES))
    parser.add_argument("--options", default="",
                        help="more fairseq-generate options for every run (one string, split as a shell would)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    best = run_all(args)
    rows = []
    print("bench_threads: {}; {} {}, batch {}{}; fastest of {} rounds".format(
        cpu_model(), args.checkpoint, args.subset, args.batch_size,
        ", options " + args.options if args.options else "", args.rounds))
    print("{:<8} {:<8} {:<14} {:<22} {:>8} {:>12}".format("tree", "model", "search", "layout", "seconds",
                                                        "x 1 thread"))
    for (tree, precision, search, layout), r in best.items():
        one = best[(tree, precision, search, "1 thread")]["seconds"]
        rows.append({"tree": tree, "precision": precision, "search": search, "layout": layout,
                     "seconds": round(r["seconds"], 3), "over_one_thread": round(r["seconds"] / one, 3)})
        print("{:<8} {:<8} {:<14} {:<22} {:>8.2f} {:>11.2f}x".format(tree, precision, search, layout, r["seconds"],
                                                                     r["seconds"] / one))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_model(), "argv": sys.argv, "date": time.strftime("%Y-%m-%d"), "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
