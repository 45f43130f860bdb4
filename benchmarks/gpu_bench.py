"""Benchmark every method on a GPU at the WMT'19 size: the stand-in ensemble on newstest2017 De-En.

    python benchmarks/gpu_bench.py OUTDIR --train-text newstest201{3,4,5,6}.{de,en} \\
        --source newstest2017.de --reference newstest2017.en [--models-count 4] [--limit 300]
    (scripts/gpu_bench.sh runs it with the right interpreter)

Steps, each bounded in time:

1. ``setup`` / ``environment``: as gpu_check.py.
2. ``standin``: ``scripts/make_wmt19_standin.py de-en WORK/standin`` (``--models-count`` models of
   the published size, float16 weights for an fp16 run; ``--tiny`` on ``--device cpu``), unless
   ``--standin DIR`` already holds one (or the real ensemble).
3. ``prepare``: the first ``--limit`` lines of ``--source``/``--reference`` through Moses, the
   stand-in's fastBPE codes and dictionaries into a data-bin (fairseq_stream.newstest.prepare, as
   scripts/newstest.sh does); ``--data-bin DIR`` gives one prepared elsewhere.
4. ``behaviour``: fixed and var-batch at k=5 on the first 32 sentences with fairseq's own length
   bound: does the stand-in end its hypotheses and prune like a trained model
   (benchmarks/standin_behaviour.py)? The stand-in step trains model1 for ``--train-seconds``
   (default 120 on the GPU) on ``--train-text``'s parallel files and derives the other members from
   it (``--member-noise``), so that it does.
5. ``decode``: for each ``--beams`` K, each method's preset (``--preset NAME --beam K``), one
   fairseq-generate each (a run that takes longer than ``--run-timeout`` or crashes is recorded
   as failed and the rest go on), fp16 on the GPU (``--no-fp16`` for float32), ``--max-len-a 1.2
   --max-len-b 10`` unless the behaviour step found the stand-in trained-like (``--max-len``), in the
   targets' order (``PRIORITY``); the static-slot methods (``VARIANTS``) too. Greedy and Jacobi ignore
   the beam and run with the first beam only. Each run: wall clock (fairseq's decoding seconds and the whole
   run's), decoder calls, rows per call, host time per call, GPU busy share, peak GPU memory
   (benchmarks/gpu_probe.py says how).
6. ``report``: the rows in newstest's results format (in results.json, and WORK/results.jsonl)
   and report.py's tables and plots (OUTDIR/plots/: report.md and one bar chart and one BLEU
   scatter per beam).
7. ``targets``: issues 53's and 52's targets from the decode runs (benchmarks/gpu_targets.py).
8. ``kernels``: where the device time of a step goes, for a few runs (``--kernel-runs``: issue 52's
   4 members and 1 member in graphs, var-stream eager and in graphs, fairseq's beam): each decoded
   again, torch.profiler over ``--kernel-window`` calls of the untimed first decode
   (benchmarks/gpu_kernels.py: kernels' device ms per call by kind, launches, the costliest). Last,
   because a profiler is what could upset a CUDA context: the measured runs are done by then.

BLEU of an untrained stand-in is noise; with the real ensemble (``--standin wmt19/...``) it is
the real score.
"""

import argparse
import json
import os
import sys
from collections import OrderedDict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu_kernels  # noqa: E402
import gpu_targets  # noqa: E402
import standin_behaviour  # noqa: E402
from gpu_common import (  # noqa: E402
    NA_CPU, REPO, Session, StepError, absolute_paths, add_common_arguments, environment_step, fmt, hypotheses,
    install_wheels, summary_head,
)

# The methods, by their newstest presets (fairseq_stream/presets); beam is fairseq's own.
PRESETS = ["beam", "fixed", "var-batch", "var-stream", "var-stream-rows", "topup", "greedy", "jacobi"]
# Issue 53's static-slot step (docs/GPU.md, "Static slots"): name -> (preset, options, members). GRAPHS is
# --cuda-graphs on on the GPU, auto on the CPU (where on is refused and auto decodes eagerly). --host-lag
# holds for the dense searches only (greedy, fixed). "-1member" decodes model1 alone and "-unstacked" the
# members one after another: issue 52's 4 members against one, and stacked against not.
GRAPHS = "GRAPHS"
STATIC = ["--runner", "static"]
VARIANTS = {
    "fixed-static": ("fixed", STATIC + ["--cuda-graphs", "off"], None),
    "fixed-graphs": ("fixed", STATIC + ["--cuda-graphs", GRAPHS, "--host-lag", "2"], None),
    "fixed-graphs-1member": ("fixed", STATIC + ["--cuda-graphs", GRAPHS, "--host-lag", "2"], 1),
    "fixed-graphs-unstacked": ("fixed", STATIC + ["--cuda-graphs", GRAPHS, "--host-lag", "2",
                                                  "--stack-members", "off"], None),
    "var-stream-graphs": ("var-stream", STATIC + ["--cuda-graphs", GRAPHS], None),
    "var-batch-graphs": ("var-batch", STATIC + ["--cuda-graphs", GRAPHS], None),
    "greedy-graphs": ("greedy", STATIC + ["--cuda-graphs", GRAPHS, "--host-lag", "2"], None),
}
METHODS = PRESETS + list(VARIANTS)
BEAMLESS = ("greedy", "jacobi", "greedy-graphs")
# The order runs decode in, the targets' figures first (benchmarks/gpu_targets.py), so that a run cut
# by --deadline loses the least; runs not named here follow in --methods and --beams order.
PRIORITY = ["beam-k5", "var-stream-graphs-k5", "fixed-graphs-k5", "fixed-graphs-1member-k5", "greedy-graphs",
            "jacobi", "greedy", "var-stream-graphs-k50", "var-batch-graphs-k50", "fixed-graphs-unstacked-k5",
            "var-stream-k5", "fixed-static-k5", "var-stream-k50", "var-batch-k50"]
# Sentences per batch (and stream pool) per beam: the --gpu-memory 32 presets' (gpu32gb-k5/-k50),
# which keep every method of the 4-model ensemble within 32 GB by the presets' arithmetic.
BATCH = {5: 64, 50: 8}
# The kernels step's runs: issue 52's ratio, eager against graphs, fairseq's own beam.
KERNEL_RUNS = ["fixed-graphs-k5", "fixed-graphs-1member-k5", "var-stream-k5", "var-stream-graphs-k5", "beam-k5"]
PAIR = "de-en"
GPU_TRAIN_S = 120
BEHAVIOUR_SENTENCES = 32
BOUND = ["--max-len-a", "1.2", "--max-len-b", "10"]
PATH_OPTIONS = ("standin", "standin_text", "train_text", "source", "reference", "data_bin")


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(p)
    p.add_argument("--standin", metavar="DIR", help="a stand-in (or the real WMT'19 de-en ensemble) to use "
                                                   "instead of building one in WORK/standin")
    p.add_argument("--standin-text", metavar="DIR",
                   help="bpecodes and dictionaries built beforehand (make_wmt19_standin.py --text-only, same "
                        "--train-text): the stand-in step skips learning 32000 merges (a minute or more)")
    p.add_argument("--train-text", nargs="+", metavar="FILE",
                   help="text to learn the stand-in's BPE and dictionary from (newstest201{3,4,5,6}.{de,en})")
    p.add_argument("--models-count", type=int, default=4, metavar="N",
                   help="stand-in ensemble members (default 4, as released; 1 if 4 do not fit the time)")
    p.add_argument("--source", metavar="FILE", help="newstest2017.de (raw text, one sentence a line)")
    p.add_argument("--reference", metavar="FILE", help="newstest2017.en")
    p.add_argument("--data-bin", metavar="DIR", help="an input already prepared for this stand-in (skips prepare)")
    p.add_argument("--limit", type=int, default=300, help="the first N sentences (default %(default)s)")
    p.add_argument("--beams", type=int, nargs="+", default=[5, 50], metavar="K")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=METHODS, metavar="METHOD",
                   help="default: all: {}".format(", ".join(METHODS)))
    p.add_argument("--batch-size", type=int, metavar="N",
                   help="sentences per batch for every beam (default: {})".format(
                       ", ".join("{} at k={}".format(b, k) for k, b in BATCH.items())))
    p.add_argument("--no-fp16", action="store_true", help="decode in float32 (default on the GPU: --fp16)")
    p.add_argument("--stack-members", choices=["auto", "on", "off"], default="auto",
                   help="our methods' --stack-members (docs/ensemble.md): a run with off and one with auto measure "
                        "the stacked ensemble against member by member (auto stacks on the GPU)")
    p.add_argument("--train-seconds", type=float, metavar="S",
                   help="train the stand-in's model1 for S seconds on --train-text's parallel files (fairseq's "
                        "WMT big recipe, fp16 on the GPU) and derive the other members from it with "
                        "--member-noise (default {} on the GPU, 0 on the CPU: untrained)".format(GPU_TRAIN_S))
    p.add_argument("--member-noise", type=float, default=0.02, metavar="SIGMA",
                   help="members 2..N: model1 plus seeded noise of SIGMA times each tensor's deviation "
                        "(default %(default)s; 0: each member trains or is initialised from its own seed)")
    p.add_argument("--max-len", choices=["auto", "bound", "free"], default="auto",
                   help="bound: --max-len-a 1.2 --max-len-b 10 (untrained weights rarely emit EOS); free: "
                        "fairseq's defaults; auto (default): free when the behaviour step finds the stand-in "
                        "trained-like; where its hypotheses are under half their sources' length, --min-len "
                        "and --max-len-b the sample's median source length (--max-len-a 1.2); else bound")
    p.add_argument("--kernel-runs", nargs="*", default=KERNEL_RUNS, metavar="RUN",
                   help="runs (method-kK, or greedy/jacobi) the kernels step profiles (default: %(default)s); "
                        "none: the step is skipped")
    p.add_argument("--kernel-window", nargs=2, type=int, default=[20, 20], metavar=("FIRST", "CALLS"),
                   help="the decoder calls the kernels step records: CALLS from call FIRST (default 20 20)")
    p.add_argument("--warm-up", choices=["auto", "on", "off"], default="auto",
                   help="decode each timed run twice in a row and measure the second (the first's time is kept "
                        "as cold_decode_s): what a process pays once per shape is not charged to the method that "
                        "meets it first; auto (default): on with CUDA")
    p.add_argument("--run-timeout", type=float, default=300, metavar="S",
                   help="a decode run making no progress this long is killed (default %(default)s)")
    return p


def standin_dir(session, args):
    return os.path.abspath(args.standin or os.path.join(session.work, "standin"))


def fp16(session, args):
    return session.cuda and not args.no_fp16


def standin_step(session, args):
    """Build the stand-in with make_wmt19_standin.py unless the folder already holds an ensemble."""
    def step():
        out = standin_dir(session, args)
        if args.standin and os.path.exists(os.path.join(out, "model1.pt")):
            return {"status": "passed", "detail": "using the ensemble in {}".format(out)}
        if not args.train_text:
            raise StepError("no stand-in: give --train-text FILES (or --standin DIR)")
        argv = [args.python, os.path.join(REPO, "scripts", "make_wmt19_standin.py"), PAIR, out,
                "--models", str(args.models_count), "--train-text"] + args.train_text
        argv += ["--fp16"] if fp16(session, args) else []
        argv += [] if session.cuda else ["--tiny"]
        argv += training_options(session, args)
        argv += ["--text-from", args.standin_text] if args.standin_text else []
        rc, out_text = session.run_command(argv, "standin", 540)
        if rc != 0:
            raise StepError("make_wmt19_standin.py {}: {}".format(
                "timed out" if rc is None else "exit {}".format(rc), out_text.splitlines()[-1] if out_text else ""))
        return {"status": "passed", "detail": out_text.splitlines()[-1] if out_text else "built"}
    return step


def train_seconds(session, args):
    return args.train_seconds if args.train_seconds is not None else GPU_TRAIN_S if session.cuda else 0


def training_options(session, args):
    """make_wmt19_standin.py's training options: the --train-text files that come in .de/.en pairs."""
    seconds = train_seconds(session, args)
    prefixes = sorted({os.path.splitext(f)[0] for f in args.train_text
                       if all(os.path.exists(os.path.splitext(f)[0] + "." + lang) for lang in PAIR.split("-"))})
    if not seconds or not prefixes:
        return ["--member-noise", str(args.member_noise)] if args.member_noise else []
    return ["--train-seconds", str(seconds), "--member-noise", str(args.member_noise), "--train-prefix"] + prefixes


PREPARE = r"""
import json, sys
from fairseq_stream.newstest import prepare, testset
a = json.loads(sys.argv[1])
corpus = testset.load("de-en", "2017", source=a["source"], reference=a["reference"])
corpus.source, corpus.reference = corpus.source[:a["limit"]], corpus.reference[:a["limit"]]
enc = prepare.Encoding("moses", "fastbpe", a["codes"], None)
done = {"data_bin": prepare.prepare(corpus, "de-en", enc, a["srcdict"], a["tgtdict"], a["work"]),
        "sentences": len(corpus.source)}
corpus.source, corpus.reference = corpus.source[:a["sample"]], corpus.reference[:a["sample"]]
done["behaviour_data_bin"] = prepare.prepare(corpus, "de-en", enc, a["srcdict"], a["tgtdict"], a["work"] + "/sample")
with open(a["result"], "w") as f:
    json.dump(done, f)
"""


def prepare_step(session, args):
    """Moses, fastBPE and fairseq-preprocess with the stand-in's files (cached by content)."""
    def step():
        if args.data_bin:
            session.results["data_bin"] = os.path.abspath(args.data_bin)
            return {"status": "passed", "detail": "using the data-bin " + args.data_bin}
        if not (args.source and args.reference):
            raise StepError("give --source and --reference (newstest2017.de/.en), or --data-bin")
        d = standin_dir(session, args)
        spec = dict(source=os.path.abspath(args.source), reference=os.path.abspath(args.reference),
                    limit=args.limit, sample=min(args.limit, BEHAVIOUR_SENTENCES), codes=os.path.join(d, "bpecodes"),
                    srcdict=os.path.join(d, "dict.de.txt"),
                    tgtdict=os.path.join(d, "dict.en.txt"), work=session.work,
                    result=os.path.join(session.work, "prepare.json"))
        if os.path.exists(spec["result"]):
            os.remove(spec["result"])
        rc, out = session.run_command([args.python, "-c", PREPARE, json.dumps(spec)], "prepare", 300)
        if rc != 0:
            raise StepError("prepare {}: {}".format("timed out" if rc is None else "exit {}".format(rc),
                                                    out.splitlines()[-1] if out else ""))
        # The result comes back in a file: the log's tail cuts long lines, and the paths can be long.
        with open(spec["result"]) as f:
            done = json.load(f)
        session.results["data_bin"] = done["data_bin"]
        session.results["behaviour_data_bin"] = done["behaviour_data_bin"]
        return {"status": "passed", "detail": "{} sentences in {}".format(done["sentences"], done["data_bin"])}
    return step


def length_options(session, args):
    """fairseq's length bound for the timed decodes: --max-len, auto deciding by the behaviour step.

    auto, on a stand-in whose hypotheses are far shorter than their sources
    (60 s of training on an H200 said "The ." to every sentence): every
    hypothesis takes at least the sample's median source length, so that a
    decode takes about a trained model's steps a sentence (all about equally
    long: what streaming gains from unequal lengths is not measured so)."""
    found = session.results.get("behaviour") or {}
    if args.max_len == "auto":
        free = found.get("trained_like")
    else:
        free = args.max_len == "free"
    if free:
        return []
    if args.max_len == "auto" and standin_behaviour.too_short(found):
        # --max-len-b at least --min-len: fairseq asserts min_len <= max_len for every batch.
        least = str(found["median_source_tokens"])
        return ["--max-len-a", BOUND[1], "--max-len-b", least, "--min-len", least]
    return BOUND


def behaviour_step(session, args):
    """fixed and var-batch at k=5 on the first sentences, fairseq's length bound: standin_behaviour's figures."""
    def step():
        if not session.results.get("behaviour_data_bin"):
            raise StepError("no prepared sample (the prepare step did not pass)")
        d = standin_dir(session, args)
        checkpoints = ":".join(os.path.join(d, "model{}.pt".format(i + 1)) for i in range(models_in(d)))
        runs = [{"name": "behaviour-" + method, "method": method, "beam": 5,
                 "argv": [session.results["behaviour_data_bin"], "--path", checkpoints, "--user-dir",
                          os.path.join(REPO, "fairseq_stream"), "--preset", method, "--beam", "5",
                          "--source-lang", "de", "--target-lang", "en", "--gen-subset", "test",
                          "--batch-size", str(BEHAVIOUR_SENTENCES), "--num-workers", "0", "--log-format", "simple"]
                 # One process on the CPU: forked --cpu-workers would take their counts with them.
                 + (["--fp16"] if fp16(session, args) else [])
                 + ([] if session.cuda else ["--cpu", "--cpu-workers", "1"])}
                for method in ("fixed", "var-batch")]
        results = session.run_plan("behaviour", runs, args.run_timeout, args.device, keep_models=True)
        fixed, var = results["behaviour-fixed"], results["behaviour-var-batch"]
        found = standin_behaviour.behaviour(fixed["output"], var["output"], fixed.get("rows"), var.get("rows"))
        session.results["behaviour"] = found
        chosen = length_options(session, args)
        bound = "the timed decodes {}".format("bound their length: " + " ".join(chosen)
                                             if chosen else "use fairseq's length bound")
        return {"status": "failed" if found.get("error") else "passed", "behaviour": found, "runs": results,
                "detail": "{}; {}".format(standin_behaviour.describe(found), bound)}
    return step


def runs_for(session, args, beam, first):
    """The fairseq-generate command lines of one beam (greedy and Jacobi with the ``first`` only)."""
    d = standin_dir(session, args)
    members = [os.path.join(d, "model{}.pt".format(i + 1)) for i in range(models_in(d))]
    runs = []
    for method in args.methods:
        if method in BEAMLESS and not first:
            continue
        preset, extra, count = VARIANTS.get(method, (method, [], None))
        graphs = "on" if session.cuda else "auto"
        extra = [graphs if a == GRAPHS else a for a in extra]
        argv = [session.results["data_bin"], "--path", ":".join(members[:count]), "--user-dir",
                os.path.join(REPO, "fairseq_stream"), "--preset", preset, "--source-lang", "de", "--target-lang", "en",
                "--gen-subset", "test", "--batch-size", str(args.batch_size or BATCH.get(beam, 16)), "--num-workers",
                "0", "--log-format", "simple"] + length_options(session, args) + extra
        argv += [] if method in BEAMLESS else ["--beam", str(beam)]
        argv += ["--fp16"] if fp16(session, args) else []
        argv += [] if session.cuda else ["--cpu"]
        # fairseq's own beam takes no option of ours; auto is the default and stays off the command line.
        argv += ["--stack-members", args.stack_members] if (args.stack_members != "auto" and method != "beam"
                                                            and "--stack-members" not in extra) else []
        runs.append({"name": method if method in BEAMLESS else "{}-k{}".format(method, beam), "argv": argv,
                     "method": method, "beam": None if method in BEAMLESS else beam})
    return runs


def ordered_runs(session, args):
    """Every beam's runs, those of :data:`PRIORITY` first in its order."""
    runs = [r for i, beam in enumerate(args.beams) for r in runs_for(session, args, beam, i == 0)]
    rank = {name: i for i, name in enumerate(PRIORITY)}
    return sorted(runs, key=lambda r: rank.get(r["name"], len(rank)))  # stable: the rest keep their order


def models_in(folder):
    """How many model1.pt, model2.pt, ... the folder holds."""
    n = 0
    while os.path.exists(os.path.join(folder, "model{}.pt".format(n + 1))):
        n += 1
    if not n:
        raise StepError("no model1.pt in {}".format(folder))
    return n


def decode_step(session, args):
    """Every method at every beam, in one probe process (restarted past a run that kills it)."""
    def step():
        if not session.results.get("data_bin"):
            raise StepError("no prepared input (the prepare step did not pass)")
        runs = ordered_runs(session, args)
        warm = args.warm_up == "on" or (args.warm_up == "auto" and session.cuda)
        results = session.run_plan("decode", runs, args.run_timeout, args.device, keep_models=True, warm_up=warm)
        for run in runs:
            results[run["name"]].update(method=run["method"], beam=run["beam"])
        # A resumed decode of some methods (--methods) keeps the runs an earlier one measured and this one
        # did not plan: a lent machine's second command adds to its first, it does not replace it.
        earlier = (session.earlier.get("decode") or {}).get("runs") or {}
        results = dict([(n, dict(r, resumed=True)) for n, r in earlier.items() if n not in results]
                       + list(results.items()))
        failed = [n for n, r in results.items() if r.get("error") or not r.get("sentences")]
        return {"status": "failed" if failed else "passed", "runs": results,
                "length_options": length_options(session, args),
                "detail": "{} of {} runs decoded{}".format(len(results) - len(failed), len(results),
                                                           "; failed: " + ", ".join(failed) if failed else "")}
    return step


def kernels_step(session, args):
    """The device time of a step by kernel kind, for ``--kernel-runs`` (gpu_kernels.py), in a plan of its own."""
    def step():
        if not session.results.get("data_bin"):
            raise StepError("no prepared input (the prepare step did not pass)")
        runs = [r for r in ordered_runs(session, args) if r["name"] in args.kernel_runs]
        if not runs:
            return {"status": "skipped", "detail": "none of --kernel-runs is among this run's methods and beams"}
        first, calls = args.kernel_window
        results = session.run_plan("kernels", runs, args.run_timeout, args.device, keep_models=True, warm_up=True,
                                   profile={"first": first, "calls": calls})
        profiled = OrderedDict((n, {"kernels": r.get("kernels"), "error": r.get("error")}) for n, r in results.items())
        done = [n for n, r in profiled.items() if r["kernels"] and not r["error"]]
        missed = [n for n in profiled if n not in done]
        return {"status": "passed" if done else "failed", "profiled": profiled, "window": [first, calls],
                "detail": "{} of {} runs profiled{}".format(len(done), len(profiled),
                                                           "; not: " + ", ".join(missed) if missed else "")}
    return step


def render_kernels(step):
    """The kernels step's table: device ms per call by kind (CPU ms of ATen operators on the CPU)."""
    profiled = step.get("profiled") or {}
    kinds = [k for k, _ in gpu_kernels.KINDS] + [gpu_kernels.OTHER]
    first, calls = step.get("window", [None, None])
    lines = ["", "## Where a step's time goes (kernels step, gpu_kernels.py)", "",
             "torch.profiler over decoder calls {} to {} of each run's untimed first decode: the kernels' "
             "device time per call by kind (on the CPU: ATen operators' own CPU time), kernels (on the CPU: "
             "operators) launched or replayed per call, and the costliest kernel.".format(
                 first, None if first is None else first + calls),
             "", "| run | clock | ms/call | kernels/call | " + " | ".join(kinds) + " | costliest |",
             "| --- | --- | ---: | ---: | " + " | ".join("---:" for _ in kinds) + " | --- |"]
    for name, r in profiled.items():
        k = r.get("kernels")
        if not k:
            why = (r.get("error") or "window not reached").replace("|", "/")
            lines.append("| {} | — | — | — | {} | {} |".format(name, " | ".join("—" for _ in kinds), why))
            continue
        top = k["top"][0] if k["top"] else None
        lines.append("| {} | {} | {:.3f} | {:.0f} | {} | {} |".format(
            name, k["clock"], k["ms_per_call"], k["launches_per_call"],
            " | ".join(fmt(k["by_kind"].get(kind), ".3f") for kind in kinds),
            "{} ({:.3f} ms)".format(top["name"][:60].replace("|", "/"), top["ms_per_call"]) if top else "—"))
    return lines


def bleu_of(output, reference_lines):
    """sacreBLEU of the H- lines, BPE joined (the stand-in's are noise); None without sacrebleu."""
    try:
        from sacrebleu.metrics import BLEU
    except ImportError:
        return None
    hyps = {i: text.replace("@@ ", "") for i, (_, text) in (hypotheses(output) or {}).items()}
    if sorted(hyps) != list(range(len(reference_lines))):
        return None
    return round(BLEU().corpus_score([hyps[i] for i in range(len(hyps))], [reference_lines]).score, 2)


def report_step(session, args):
    """results.jsonl in newstest's format, then report.py's tables and plots into OUTDIR/plots."""
    def step():
        rows = []
        device = session.results.get("environment", {}).get("gpu") if session.cuda else None
        device = "cuda: {}{}".format(device, " fp16" if fp16(session, args) else "") if session.cuda else "cpu"
        reference = None
        if args.reference:
            with open(args.reference, encoding="utf-8") as f:
                reference = f.read().split("\n")[:args.limit]
        for s in [session.results["steps"].get("decode", {})]:
            for r in (s.get("runs") or {}).values():
                if r.get("error") or not r.get("sentences"):
                    continue
                bleu = bleu_of(r["output"], reference) if reference else None
                rows.append({"pair": PAIR, "testset": "newstest2017", "method": r["method"], "beam": r["beam"],
                             "bleu": bleu, "decode_s": r["decode_s"], "wall_s": r["process_s"],
                             "counters": {"timesteps": r["calls"], "expansions": r["rows"],
                                          "expansions_per_step": r["rows_per_call"]},
                             "device": device, "sentences": r["sentences"], "host_ms_per_call": r["host_ms_per_call"],
                             "gpu_busy": r["gpu_busy"], "peak_mib": r["peak_mib"], "commit": session.results["commit"]})
        if not rows:
            raise StepError("no run decoded")
        jsonl = os.path.join(session.work, "results.jsonl")  # report.py's input; the rows are in results.json too
        with open(jsonl, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        plots = os.path.join(session.outdir, "plots")
        rc, out = session.run_command([args.python, os.path.join(REPO, "scripts", "report.py"), jsonl, "--out", plots],
                                      "report", 120)
        if rc != 0:
            raise StepError("report.py {}: {}".format("timed out" if rc is None else "exit {}".format(rc),
                                                      out.splitlines()[-1] if out else ""))
        pngs = sorted(f for f in os.listdir(plots) if f.endswith(".png"))
        return {"status": "passed", "detail": "{} rows; {} plots in {}".format(len(rows), len(pngs), plots),
                "plots": pngs, "rows": rows}
    return step


def targets_step(session, args):
    """Issue 53's and 52's targets from the decode step's runs (benchmarks/gpu_targets.py)."""
    def step():
        runs = session.results["steps"].get("decode", {}).get("runs") or {}
        if not runs:
            raise StepError("no decode runs")
        reference = None
        if args.reference:
            with open(args.reference, encoding="utf-8") as f:
                reference = f.read().split("\n")[:args.limit]
        bleu = {n: bleu_of(r.get("output"), reference) if reference and not r.get("error") else None
                for n, r in runs.items()}
        found = gpu_targets.targets(runs, bleu)
        met = sum(t["met"] is True for t in found)
        known = sum(t["met"] is not None for t in found)
        return {"status": "passed", "targets": found,
                "detail": "{} of {} targets measured, {} met{}".format(
                    known, len(found), met, "" if session.cuda else " (CPU: the figures are not the targets')")}
    return step


def render(results):
    """summary.md: the steps and every run's measurements."""
    lines = summary_head(results, "GPU benchmark")
    na = NA_CPU if results["device"] == "cpu" else "—"
    rows = [r for s in results["steps"].values() for r in (s.get("runs") or {}).values()]
    if rows:
        lines += ["", "## Runs", "",
                  "decode s: fairseq's own decoding time (with --warm-up, of the second of two decodes in a "
                  "row; cold s: the first's); process s: the whole fairseq-generate run, model loading included "
                  "unless the plan had already loaded the members (models_kept); host ms/call: median time "
                  "between decoder calls' starts, no synchronization; ms/call: decode s over calls; GPU busy: "
                  "NVML utilization between the first and the last call; peak MiB: "
                  "torch.cuda.max_memory_allocated.", "",
                  "| method | k | sentences | decode s | cold s | process s | calls | rows/call | host ms/call | "
                  "ms/call | GPU busy | peak MiB | error |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
        for r in rows:
            busy = r.get("gpu_busy")
            lines.append("| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |".format(
                r.get("method", r["name"]), fmt(r.get("beam")), fmt(r.get("sentences")), fmt(r.get("decode_s"), ".2f"),
                fmt(r.get("cold_decode_s"), ".2f"), fmt(r.get("process_s"), ".1f"), fmt(r.get("calls")),
                fmt(r.get("rows_per_call"), ".1f"),
                fmt(r.get("host_ms_per_call"), ".2f"), fmt(r.get("ms_per_call"), ".2f"),
                na if busy is None else "{:.0%}".format(busy), fmt(r.get("peak_mib"), ".0f", na),
                (r.get("error") or "").replace("|", "/")))
    found = results["steps"].get("targets", {}).get("targets")
    if found:
        lines += ["", "## Targets (issues 53 and 52)", ""] + gpu_targets.render(found)
    if (results["steps"].get("kernels") or {}).get("profiled"):
        lines += render_kernels(results["steps"]["kernels"])
    report = results["steps"].get("report", {})
    if report.get("plots"):
        lines += ["", "## report.py's plots (plots/)", ""] + ["![{0}](plots/{0})".format(p) for p in report["plots"]]
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parser().parse_args(argv)
    absolute_paths(args, PATH_OPTIONS)  # the children run in the repository's root
    session = Session("gpu_bench", args, render)

    def setup():
        if not args.wheels:
            return {"status": "skipped", "detail": "no --wheels: the interpreter's own packages"}
        site, count, note = install_wheels(session, args.wheels)
        return {"status": "passed", "detail": "{} files installed into {}{}".format(count, site, note)}

    session.step("setup", setup)
    session.step("environment", lambda: environment_step(session, ["sacremoses", "subword_nmt", "fastBPE"]))
    session.step("standin", standin_step(session, args), needs_s=30)
    session.step("prepare", prepare_step(session, args), needs_s=10)
    session.step("behaviour", behaviour_step(session, args), needs_s=20)
    session.step("decode", decode_step(session, args), needs_s=30)
    session.step("report", report_step(session, args), needs_s=5)
    session.step("targets", targets_step(session, args), needs_s=1)
    session.step("kernels", kernels_step(session, args), needs_s=30)
    return session.finish()


if __name__ == "__main__":
    sys.exit(main())
