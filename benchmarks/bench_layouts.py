"""Each tool's CPU layouts on 1 and 2 cores, before and after a change: fairseq-generate, fairseq-interactive and
the Python API (issue 50).

bench_interop.py sets our fairseq-generate against CTranslate2 and
bench_threads.py times kernel threads; this script times the three ways a
user decodes, each in every layout of the cores, for the trees given
(checkouts of this repository with their kernels built), on the same input:

* ``1 core``: ``taskset`` to the first core, the default layout (one process,
  one thread);
* ``2 cores, default``: the first two cores, no layout option: what a user
  gets;
* ``2 workers``: ``--cpu-workers 2`` (the API's ``cpu_workers=2``);
* ``1 worker x 2 threads``: ``--cpu-workers 1`` (``cpu_workers=1``).

Seconds: fairseq-generate and fairseq-interactive, the decode's wall window
our closing counters print (the first ``generate`` call's start to the last
one's end: with workers the parent prints while they decode ahead, so the
time inside the calls says little); the API, the wall time of one
``translate()`` call over every line, in a process of its own, a first call
(the workers, where asked for, are forked for it); ``--api-calls N`` makes N
calls on the same Translator and records the later ones too. The whole process is
recorded beside each. Every run of a tree and tool must give that tree's
first run's translations (the texts of the best hypotheses), or the script
stops: a layout changes when work is done, never what is produced. The
fastest of ``--rounds`` interleaved rounds counts.

    python benchmarks/bench_layouts.py DATA_BIN CHECKPOINT TEXT --trees before=/path after=. \\
        [--subset test] [--batch-size 64] [--tools generate interactive api] \\
        [--searches 'var-stream k=5' greedy] [--precisions int8] [--options '-s de -t en'] \\
        [--rounds 2] [--json FILE]

TEXT is the subset's source side as fairseq-interactive and the API read it
(for the Multi30k model: the sentencepiece pieces, ``spm/test.de``); the
checkpoint's own ``--bpe``/``--tokenizer`` are used where it has them, else
``--text-options`` (e.g. ``--bpe fastbpe --bpe-codes CODES --tokenizer moses``
for the stand-in) for both tools.
"""

import argparse
import hashlib
import json
import os
import shlex
import subprocess
import sys
import time

import preamble  # noqa: F401  (first: paths)
from bench_interop import WINDOW, load, pinned
from bench_threads import PRECISIONS, SEARCHES, cpu_model

# (label, cores, --cpu-workers or None for the default)
LAYOUTS = [("1 core", 1, None), ("2 cores, default", 2, None), ("2 workers", 2, 2), ("1 worker x 2 threads", 2, 1)]
BIN = os.path.dirname(sys.executable)

API_DRIVER = r"""
import hashlib, json, sys, time
from fairseq_stream.api import Translator
spec = json.loads(sys.argv[1])
lines = open(spec["text"]).read().splitlines()
t = Translator(spec["checkpoint"], data=spec["data_bin"], cpu=True, **spec["arguments"])
calls, digests = [], set()
for _ in range(spec["calls"]):
    start = time.perf_counter()
    texts = {tr.index: tr.text for tr in t.translate(lines)}
    calls.append(time.perf_counter() - start)
    assert sorted(texts) == list(range(len(lines))), "a sentence without exactly one translation"
    digests.add(hashlib.sha1("\n".join(texts[i] for i in range(len(lines))).encode()).hexdigest())
assert len(digests) == 1, "another call translated otherwise"
print(json.dumps({"seconds": calls[0], "later_calls_s": calls[1:], "outputs": digests.pop(), "lines": len(lines)}))
"""


def layout_options(workers):
    return [] if workers is None else ["--cpu-workers", str(workers)]


def run_tool(tree, tool, args, options, cores, workers):
    """(seconds, whole process seconds, outputs' digest, the API's later calls' seconds or None) of one run."""
    prefix, env = pinned(cores)
    env = dict(os.environ, PYTHONPATH=tree, **env)
    user_dir = os.path.join(tree, "fairseq_stream")
    stdin = None
    if tool == "api":
        arguments = api_arguments(options + shlex.split(args.options), args.batch_size, args.maxi_batch)
        if workers is not None:
            arguments["cpu_workers"] = workers
        argv = prefix + [sys.executable, "-c", API_DRIVER, json.dumps(dict(
            text=args.text, checkpoint=args.checkpoint, data_bin=args.data_bin, arguments=arguments,
            calls=args.api_calls))]
    elif tool == "generate":
        argv = prefix + [os.path.join(BIN, "fairseq-generate"), args.data_bin, "--path", args.checkpoint,
                         "--user-dir", user_dir, "--gen-subset", args.subset, "--batch-size", str(args.batch_size),
                         "--cpu"] + options + shlex.split(args.options) + layout_options(workers)
    else:
        argv = prefix + [os.path.join(BIN, "fairseq-interactive"), args.data_bin, "--path", args.checkpoint,
                         "--user-dir", user_dir, "--batch-size", str(min(args.batch_size, args.buffer_size)),
                         "--buffer-size", str(args.buffer_size), "--cpu"] + options + shlex.split(args.options) + \
            shlex.split(args.text_options) + layout_options(workers)
        stdin = open(args.text)
    start = time.perf_counter()
    # In the tree: ``python -c`` puts the working directory before PYTHONPATH, so elsewhere in a checkout the
    # API would import that checkout's fairseq_stream.
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, stdin=stdin, cwd=tree)
    whole = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit("bench_layouts: {} failed ({}):\n{}".format(" ".join(argv), proc.returncode, proc.stderr[-3000:]))
    if tool == "api":
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        return result["seconds"], whole, result["outputs"], [round(s, 3) for s in result["later_calls_s"]]
    window = WINDOW.search(proc.stderr)
    if window is None:
        sys.exit("bench_layouts: {} printed no decode window".format(" ".join(argv)))
    best = {}  # sentence id -> its best hypothesis's text (the first H line: --nbest 1 is the tools' default)
    for line in proc.stdout.splitlines():
        if line.startswith("H-"):
            head, _score, text = (line.split("\t") + [""])[:3]
            best.setdefault(int(head[2:]), text)
    digest = hashlib.sha1("\n".join(best[i] for i in sorted(best)).encode()).hexdigest()
    return float(window.group(1)), whole, digest, None


def api_arguments(options, batch_size, maxi_batch):
    """The Translator's arguments for fairseq-generate's search options (the subset this script uses)."""
    flags = dict(zip(options[::2], options[1::2]))
    unknown = set(flags) - {"--search", "--beam", "--quantize", "--runner", "--max-len-a", "--max-len-b", "-s", "-t"}
    if unknown:
        sys.exit("bench_layouts: the API run does not take {}".format(sorted(unknown)))
    arguments = {"search": flags["--search"], "beam": int(flags.get("--beam", 1)), "pool": batch_size,
                 "batch_size": batch_size, "maxi_batch": maxi_batch}
    for flag, name, kind in (("--quantize", "quantize", str), ("--runner", "runner", str),
                             ("--max-len-a", "max_len_a", float), ("--max-len-b", "max_len_b", int)):
        if flag in flags:
            arguments[name] = kind(flags[flag])
    return arguments


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data_bin")
    parser.add_argument("checkpoint")
    parser.add_argument("text", help="the subset's source lines as fairseq-interactive and the API read them")
    parser.add_argument("--trees", nargs="+", default=["this=" + preamble.REPO], help="NAME=PATH ...")
    parser.add_argument("--subset", default="test")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--buffer-size", type=int, default=1,
                        help="fairseq-interactive's (its default: 1; its batches hold at most this many lines)")
    parser.add_argument("--maxi-batch", type=int, default=1, help="the API's (its default: 1, input order)")
    parser.add_argument("--tools", nargs="+", choices=["generate", "interactive", "api"],
                        default=["generate", "interactive", "api"])
    parser.add_argument("--searches", nargs="+", choices=sorted(SEARCHES), default=["var-stream k=5"])
    parser.add_argument("--precisions", nargs="+", choices=sorted(PRECISIONS), default=["int8"])
    parser.add_argument("--layouts", nargs="+", choices=[label for label, _, _ in LAYOUTS],
                        default=[label for label, _, _ in LAYOUTS])
    parser.add_argument("--api-calls", type=int, default=1,
                        help="translate() calls on one Translator (the first is timed; the later ones are recorded "
                             "as later_calls_s: kept workers, warm buffers)")
    parser.add_argument("--options", default="", help="more options for every run (e.g. '-s de -t en')")
    parser.add_argument("--text-options", default="", help="fairseq-interactive's text options (--bpe ...)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    args.text = os.path.abspath(args.text)
    trees = dict(t.split("=", 1) for t in args.trees)
    machine = cpu_model()
    print("bench_layouts: {}; {} rounds".format(machine, args.rounds), flush=True)
    best, reference = {}, {}
    for round_ in range(args.rounds):
        for tree_name, tree in trees.items():
            for tool in args.tools:
                for precision in args.precisions:
                    for search in args.searches:
                        for label, cores, workers in LAYOUTS:
                            if label not in args.layouts:
                                continue
                            before = load()
                            seconds, whole, outputs, later_calls = run_tool(
                                tree, tool, args, SEARCHES[search] + PRECISIONS[precision], cores, workers)
                            case = (tree_name, tool, precision, search)
                            if reference.setdefault(case, outputs) != outputs:
                                sys.exit("bench_layouts: {} in layout '{}' translated otherwise than its first run"
                                         .format(case, label))
                            key = case + (label,)
                            row = {"tree": tree_name, "tool": tool, "precision": precision, "search": search,
                                   "layout": label, "seconds": round(seconds, 3), "process_s": round(whole, 3),
                                   "load_before": before, "load_after": load()}
                            if later_calls:
                                row["later_calls_s"] = later_calls
                            if key not in best or seconds < best[key]["seconds"]:
                                best[key] = row
                            print("  round {} {:<7} {:<11} {:<7} {:<14} {:<21} {:6.2f} s  process {:6.2f} s  load {}"
                                  .format(round_ + 1, tree_name, tool, precision, search, label, seconds, whole,
                                          before) + ("  later calls {}".format(row["later_calls_s"])
                                                     if "later_calls_s" in row else ""), flush=True)
    rows = list(best.values())
    print("\nfastest of {} rounds; x: the tree's 1 core over this".format(args.rounds))
    for row in rows:
        one = best.get((row["tree"], row["tool"], row["precision"], row["search"], "1 core"))
        row["over_1_core"] = round(one["seconds"] / row["seconds"], 2) if one else None
        print("  {tree:<7} {tool:<11} {precision:<7} {search:<14} {layout:<21} {seconds:6.2f} s".format(**row)
              + ("  {:.2f}x".format(row["over_1_core"]) if row["over_1_core"] else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "date": time.strftime("%Y-%m-%d"), "argv": sys.argv[1:],
                       "trees": trees, "rounds": args.rounds, "results": rows}, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
