"""fairseq-generate's parent process with ``--cpu-workers``: its CPU over the output loop, and the decode's window.

With CPU workers the parent decodes nothing: it reads batches, hands them
out, and runs fairseq-generate's own loop over each sentence (strings,
scores, the BLEU scorer, printing), on the cores the workers decode on
(issue 50). For each checkout given (``--tree``, default this one) and each
search, this runs the real ``fairseq-generate --cpu --cpu-workers N`` on the
Multi30k model (``--m30k DIR``, as bench_interop.py finds it), rounds
interleaved, and records the parent's CPU (user + sys of every thread, from
the first ``generate`` call to the end of the output loop), the window our
closing counters write to ``--stats-file``, the machine's load before and
after, and a digest of every output line but the log's; every checkout must
print the same lines, or the script stops. float32 searches are the
exception: a checkout whose float32 products sum in another order (another
GEMM) prints other scores in their last digits and may print other
hypotheses for a few sentences, so there each run records how many of its
hypotheses (the H lines' text, not their scores) differ from the first
checkout's first run.

It also records what the worker processes spend over their lives (their CPU,
of it the kernel's, and their minor page faults, read from /proc every 20
ms) and the other child processes' CPU (fairseq's data loader), so that
``--workers 2 1`` sets two workers' CPU beside one process decoding the same
batches (with one worker the parent decodes, and its loop CPU is the
decode's and the output's).

    python benchmarks/bench_parent_cpu.py --tree ../main --tree . [--rounds 3] [--json out.json]
    python benchmarks/bench_parent_cpu.py --workers 2 1 --searches "int8 greedy" [--rounds 3]

``--remove-bpe`` detokenizes with the model's sentencepiece model, as a user
scoring real text does; fairseq-generate then also encodes each target and
hypothesis again for its BLEU scorer (``Dictionary.encode_line``).
"""

import argparse
import glob
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time

SEARCHES = {"int8 fixed k=5": ["--quantize", "int8", "--search", "fixed", "--beam", "5", "--runner", "lean"],
            "int8 var-batch k=5": ["--quantize", "int8", "--search", "var-batch", "--beam", "5"],
            "int8 greedy": ["--quantize", "int8", "--search", "greedy"],
            "float32 fixed k=5": ["--search", "fixed", "--beam", "5", "--runner", "lean"],
            "float32 var-batch k=5": ["--search", "var-batch", "--beam", "5"]}
BIN = os.path.dirname(sys.executable)


def measured_main():
    """In the child: fairseq-generate's main with the parent's CPU taken around its output loop."""
    from fairseq.tasks.fairseq_task import FairseqTask
    from fairseq_cli import generate

    marks = {}
    cpu = lambda: sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
    faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    kernel = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_stime
    step, loop = FairseqTask.inference_step, generate._main

    def inference_step(self, *args, **kwargs):
        marks.setdefault("start", cpu())
        marks.setdefault("start_faults", faults())
        marks.setdefault("start_kernel", kernel())
        return step(self, *args, **kwargs)

    def _main(cfg, output_file):
        try:
            return loop(cfg, output_file)
        finally:
            marks["end"] = cpu()
            marks["end_faults"] = faults()
            marks["end_kernel"] = kernel()

    FairseqTask.inference_step, generate._main = inference_step, _main
    sys.argv = ["fairseq-generate"] + sys.argv[2:]
    try:
        generate.cli_main()
    finally:
        print("parent_loop_cpu_s {:.3f} parent_loop_minflt {} parent_loop_sys_s {:.3f}".format(
            marks["end"] - marks["start"], marks["end_faults"] - marks["start_faults"],
            marks["end_kernel"] - marks["start_kernel"]), file=sys.stderr, flush=True)


TICK = os.sysconf("SC_CLK_TCK")


def descendants_usage(root: int, seen: dict):
    """Record in ``seen`` {pid: (CPU s, minor faults, kernel CPU s)} of ``root``'s descendants now (from /proc;
    each pid's last reading before it exits is what stays)."""
    parents = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open("/proc/{}/stat".format(name)) as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            # after the command: state ppid ... minflt (7th) ... utime (12th) stime (13th)
            parents[int(name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK, int(fields[7]),
                                  int(fields[12]) / TICK)
    family = {root}
    grew = True  # a child's pid may be below its parent's: repeat until no pid joins
    while grew:
        grew = False
        for pid, (ppid, *_) in parents.items():
            if ppid in family and pid not in family:
                family.add(pid)
                grew = True
    for pid in family - {root}:
        seen[pid] = parents[pid][1:]


def detokenizing(model_dir):
    """fairseq-generate's options to detokenize with the model's sentencepiece model, as a user scoring real
    text passes them: fairseq then encodes each target and hypothesis again for its BLEU scorer."""
    models = sorted(glob.glob(os.path.join(model_dir, "spm", "*.model")))
    if not models:
        sys.exit("bench_parent_cpu: --remove-bpe: no sentencepiece model in {}/spm".format(model_dir))
    return ["--bpe", "sentencepiece", "--sentencepiece-model", models[0], "--remove-bpe", "sentencepiece"]


def run(tree, model_dir, options, workers):
    """One fairseq-generate run of ``tree``: (parent loop CPU s, window s, output lines but the log's,
    {"parent_loop_minflt", "parent_loop_sys_s", "workers_cpu_s", "workers_minflt", "workers_sys_s",
    "other_children_cpu_s"}: the parent's minor page faults and kernel CPU over its loop, the worker processes'
    CPU, minor page faults and kernel CPU over their lives, read from /proc every 20 ms, and the other child
    processes' CPU)."""
    with tempfile.TemporaryDirectory() as tmp:
        stats = os.path.join(tmp, "stats.json")
        argv = [sys.executable, os.path.abspath(__file__), "--child", os.path.join(model_dir, "data-bin"),
                "--path", os.path.join(model_dir, "transformer", "checkpoint_best.pt"), "--user-dir",
                os.path.join(tree, "fairseq_stream"), "--gen-subset", "test", "--batch-size", "64", "--cpu",
                "--cpu-workers", str(workers), "--cpu-threads", "1", "--stats-file", stats] + options
        env = dict(os.environ, PYTHONPATH=tree, PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS=str(workers))
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tree)
        seen, done = {}, threading.Event()

        def poll():
            while not done.is_set():
                descendants_usage(proc.pid, seen)
                time.sleep(0.02)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        stdout, stderr = proc.communicate()
        done.set()
        poller.join()
        if proc.returncode != 0:
            sys.exit("bench_parent_cpu: {} failed:\n{}".format(" ".join(argv), stderr[-3000:]))
        cpu, _, parent_faults, _, parent_sys = stderr.rsplit("parent_loop_cpu_s ", 1)[1].split()[:5]
        window = json.load(open(stats))["window_s"]
    lines = [line for line in stdout.splitlines() if not line[:4].isdigit()]  # log lines start with the date
    pids = set()
    for line in stderr.splitlines():  # Workers' log line: "N CPU workers started (processes P1 P2)"
        if "CPU workers started (processes" in line:
            pids = {int(p) for p in line.rsplit("(processes", 1)[1].strip(" )").split()}
    workers = [seen[p] for p in pids if p in seen]  # (CPU s, minor faults, kernel CPU s) each
    children = {"parent_loop_minflt": int(parent_faults), "parent_loop_sys_s": float(parent_sys),
                "workers_cpu_s": round(sum(w[0] for w in workers), 3),
                "workers_minflt": sum(w[1] for w in workers),
                "workers_sys_s": round(sum(w[2] for w in workers), 3),
                "other_children_cpu_s": round(sum(v[0] for p, v in seen.items() if p not in pids), 3)}
    return float(cpu), window, lines, children


def hypotheses(lines):
    """{sentence id: its best hypothesis' text} from fairseq-generate's H lines (H-id, score, text)."""
    return {line.split("\t")[0]: line.split("\t")[-1] for line in lines if line.startswith("H-")}


def main():
    # Here, not at the top: the child must import fairseq_stream from the checkout it runs, not this one.
    import preamble
    from bench_threads import cpu_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="append", help="a checkout to run (default: this one)")
    parser.add_argument("--m30k", default=os.path.join(preamble.REPO, "runs", "m30k"))
    parser.add_argument("--workers", type=int, nargs="+", default=[2],
                        help="--cpu-workers of each run (several: each round runs each; 1 decodes in the parent, "
                             "whose loop CPU is then the decode's and the output's)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--searches", nargs="+", default=list(SEARCHES), choices=list(SEARCHES))
    parser.add_argument("--remove-bpe", action="store_true",
                        help="detokenize as a user scoring text does (--bpe sentencepiece --remove-bpe sentencepiece)")
    parser.add_argument("--json", help="write every run here")
    args = parser.parse_args()
    extra = detokenizing(args.m30k) if args.remove_bpe else []
    trees = [os.path.abspath(t) for t in (args.tree or [preamble.REPO])]
    rows, first_lines = [], {}  # each search's lines from its first run
    print("bench_parent_cpu: {}".format(cpu_model()), flush=True)
    for _ in range(args.rounds):
        for search in args.searches:
            for tree, workers in [(t, w) for t in trees for w in args.workers]:
                before = round(os.getloadavg()[0], 2)
                cpu, window, lines, children = run(tree, args.m30k, SEARCHES[search] + extra, workers)
                first = first_lines.setdefault(search, lines)
                float32 = search.startswith("float32")
                if first != lines and not float32:
                    sys.exit("bench_parent_cpu: {} printed other lines with {}".format(tree, search))
                rows.append({"tree": tree, "workers": workers, "search": search, "parent_loop_cpu_s": cpu,
                             "window_s": window,
                             "load": [before, round(os.getloadavg()[0], 2)],
                             **children, "digest": hashlib.sha256("\n".join(lines).encode()).hexdigest()})
                if float32:
                    rows[-1]["hypotheses_differing_from_first"] = len(
                        set(hypotheses(first).items()) - set(hypotheses(lines).items()))
                print("  {search:<20} {tree:<30} {workers} worker(s)  parent CPU {parent_loop_cpu_s:6.3f} s "
                      "(sys {parent_loop_sys_s:.2f} s, {parent_loop_minflt} minor faults)  window {window_s:7.3f} s  "
                      "workers CPU {workers_cpu_s:6.3f} s (sys {workers_sys_s:.2f} s, {workers_minflt} minor faults)  "
                      "other children {other_children_cpu_s:.3f} s  load {load}".format(**rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_model(), "argv": sys.argv, "date": time.strftime("%Y-%m-%d"), "runs": rows}, f,
                      indent=1)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        measured_main()
    else:
        main()
