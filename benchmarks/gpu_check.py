"""Validate the GPU path in one command: build, CUDA tests, every search on the GPU against the CPU.

    python benchmarks/gpu_check.py OUTDIR [--device cuda|cpu] [--toy DIR] [--m30k DIR] [--wheels DIR]
    (scripts/gpu_check.sh runs it with the right interpreter)

Steps, each bounded in time (docs/GPU.md says what each proves):

1. ``setup``: with ``--wheels DIR``, pip-install the wheels a bare GPU machine lacks (fairseq-fixed,
   hydra-core, ...) into WORK/site; without it, nothing.
2. ``environment``: python, torch, CUDA, GPU, nvcc, fairseq, pynvml.
3. ``build``: ``setup.py build_ext --inplace``: the CPU kernels and, on a CUDA machine with nvcc,
   ``fairseq_stream._ops_cuda``; both must load. On ``--device cpu``: skipped (CI compiles the CUDA
   sources with scripts/check_cuda_compile.sh instead).
4. ``cuda-tests``: every test whose name or marker says cuda (pytest -k cuda), on the toy (the static
   step's CUDA graphs among them: tests/test_step_graphs.py).
5. ``decode-MODEL-cpu``: the reference, every method on the CPU (float32) through fairseq-generate.
6. ``decode-MODEL-cuda-fp32`` and ``-fp16``: the same command lines on the GPU (``--fp16``).
7. ``compare``: the printed hypotheses (H- lines) against each other: exactly where the plugin
   promises it (greedy and Jacobi GPU = CPU; fixed = fairseq's beam on the same device, scores
   too; Jacobi = greedy), else the share of identical sentences against a sanity floor.

MODEL is ``toy`` (always) and ``m30k`` (with ``--m30k``, the folder scripts/train_multi30k.sh
writes). Every decode reports decoder calls, rows per call, host time per call, GPU busy share and
peak GPU memory (benchmarks/gpu_probe.py says how each is measured). OUTDIR gets results.json,
summary.md and details.tar.gz (logs, per-run JSON, hypotheses).
"""

import argparse
import importlib.util
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_common import (  # noqa: E402
    NA_CPU, REPO, Session, StepError, absolute_paths, add_common_arguments, environment_step, fmt, hypotheses,
    install_wheels, summary_head,
)

# name -> (fairseq-generate options, which checkpoint). Every search and generator of the plugin,
# both runners where the choice matters, and fairseq's own beam search as the reference.
METHODS = [
    ("beam", ["--search", "beam", "--beam", "5"], "transformer"),
    ("fixed", ["--search", "fixed", "--beam", "5"], "transformer"),  # runner auto: fairseq (bitwise promise)
    ("fixed-lean", ["--search", "fixed", "--beam", "5", "--runner", "lean"], "transformer"),
    ("fixed-stay", ["--search", "fixed", "--finalize", "stay", "--beam", "5"], "transformer"),
    ("var-batch", ["--search", "var-batch", "--beam", "5", "--runner", "lean"], "transformer"),
    ("var-batch-fairseq", ["--search", "var-batch", "--beam", "5", "--runner", "fairseq"], "transformer"),
    ("var", ["--search", "var", "--prune-rp", "0.3", "--prune-rpl", "0.3", "--beam", "5"], "transformer"),
    ("var-stream", ["--search", "var-stream", "--beam", "5"], "transformer"),
    ("var-stream-rows", ["--search", "var-stream", "--beam", "5", "--stream-refill-unit", "rows"], "transformer"),
    ("var-fifo", ["--search", "var-batch", "--generator", "fifo", "--beam", "5"], "transformer"),
    ("fixed-stream", ["--search", "fixed", "--generator", "stream", "--beam", "5"], "transformer"),
    ("topup", ["--search", "fixed", "--generator", "topup", "--beam", "5"], "transformer"),
    ("greedy", ["--search", "greedy", "--runner", "lean"], "transformer"),
    ("greedy-fairseq", ["--search", "greedy", "--runner", "fairseq"], "transformer"),
    ("jacobi", ["--search", "jacobi"], "transformer"),
    # The static-slot step (issue 53): eager, then captured in CUDA graphs (auto: on CUDA only, so the CPU
    # reference is eager) with the host reading two calls late; rows in one bucket (the toy's 16 x 5 and
    # Multi30k's 64 x 5 fit 320), so the lag leaves the products' shapes as they were.
    ("fixed-static", ["--search", "fixed", "--beam", "5", "--runner", "static", "--static-buckets", "320:16",
                      "--cuda-graphs", "off"], "transformer"),
    ("fixed-static-graphs", ["--search", "fixed", "--beam", "5", "--runner", "static", "--static-buckets",
                             "320:16", "--cuda-graphs", "auto", "--host-lag", "2"], "transformer"),
    ("greedy-static-graphs", ["--search", "greedy", "--runner", "static", "--static-buckets", "64:16",
                              "--cuda-graphs", "auto", "--host-lag", "2"], "transformer"),
    ("beam-k50", ["--search", "beam", "--beam", "50"], "transformer"),
    ("fixed-k50", ["--search", "fixed", "--beam", "50"], "transformer"),
    ("var-stream-k50", ["--search", "var-stream", "--beam", "50"], "transformer"),
    ("lstm-beam", ["--search", "beam", "--beam", "5"], "lstm"),
    ("lstm-fixed", ["--search", "fixed", "--beam", "5"], "lstm"),
    ("lstm-greedy", ["--search", "greedy"], "lstm"),
]
METHOD_NAMES = [m[0] for m in METHODS]
PATH_OPTIONS = ("toy", "m30k")

# (kind, method, reference method, where). kind: exact = every printed hypothesis identical (with
# "scores": the score column too); near = identical except near ties, reported against a floor.
# where: "device" compares two runs of the same device and precision; "cpu" a device run with
# the CPU's run of the reference method.
CHECKS = [
    ("exact+scores", "fixed", "beam", "device"),
    ("exact+scores", "fixed-k50", "beam-k50", "device"),
    ("exact+scores", "lstm-fixed", "lstm-beam", "device"),
    ("exact", "jacobi", "greedy", "device"),
    ("exact", "greedy", "greedy", "cpu"),
    ("exact", "greedy-fairseq", "greedy-fairseq", "cpu"),
    ("exact", "jacobi", "greedy", "cpu"),
    ("exact", "lstm-greedy", "lstm-greedy", "cpu"),
    # A graph's replay launches the eager step's kernels; the late read changes nothing: the same bits.
    ("exact+scores", "fixed-static-graphs", "fixed-static", "device"),
    ("exact", "greedy-static-graphs", "greedy", "cpu"),
    ("near", "greedy", "greedy-fairseq", "device"),
    ("near", "fixed-lean", "fixed", "device"),
    ("near", "var-batch", "var-batch-fairseq", "device"),
    ("near", "var-stream", "var-batch", "device"),
    ("near", "var-stream-rows", "var-batch", "device"),
    ("near", "var-fifo", "var-batch", "device"),
    ("near", "fixed-stream", "fixed", "device"),
    ("near", "topup", "fixed", "device"),
] + [("near", m, m, "cpu") for m in METHOD_NAMES
     if m not in ("greedy", "greedy-fairseq", "lstm-greedy", "greedy-static-graphs")]
# Sanity floors for "near" checks: the share of sentences whose printed hypothesis must be identical.
# float32 moves scores in the last bits between devices and batch shapes (README: streaming), so a
# near tie can flip; half precision moves them far more. Below these, something is broken.
FLOOR_FP32 = 0.9
FLOOR_FP16 = 0.5


def load_toy_cache():
    spec = importlib.util.spec_from_file_location("toy_cache", os.path.join(REPO, "scripts", "toy_cache.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def default_toy():
    """toy/ of the quickstart where it is complete, else the trained cache folder."""
    local = os.path.join(REPO, "toy")
    if os.path.exists(os.path.join(local, "DONE")):
        return local
    return str(load_toy_cache().cache_dir())


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(p)
    p.add_argument("--toy", metavar="DIR", help="the toy checkpoints (default: toy/ if complete, else the cache "
                                               "folder scripts/toy_cache.py prints)")
    p.add_argument("--m30k", metavar="DIR", help="a Multi30k model folder (scripts/train_multi30k.sh: data-bin/, "
                                                "transformer/checkpoint_best.pt); without it the m30k steps skip")
    p.add_argument("--m30k-checkpoint", default="transformer/checkpoint_best.pt", metavar="PATH",
                   help="relative to --m30k (default: %(default)s)")
    p.add_argument("--methods", nargs="+", choices=METHOD_NAMES, metavar="METHOD",
                   help="decode only these (default: all: {})".format(", ".join(METHOD_NAMES)))
    p.add_argument("--subset", default="test", help="the toy's split to decode (default: test, 37 sentences)")
    p.add_argument("--batch-size", type=int, default=16, help="toy batch size (m30k: 64); the stream pool too")
    p.add_argument("--run-timeout", type=float, default=240, metavar="S",
                   help="a decode run making no progress this long is killed (default %(default)s)")
    p.add_argument("--no-fp16", action="store_true", help="skip the --fp16 decodes")
    p.add_argument("--tests-k", default="cuda", metavar="EXPR",
                   help="the cuda-tests step's pytest -k expression (default: %(default)s, every CUDA test; e.g. "
                        "'cuda and (step_graphs or static or host_sync or late_reads)' for issue 53's alone)")
    return p


def model_files(args, model):
    """(data-bin, {checkpoint kind: path}, subset, batch size) of the toy or the Multi30k model."""
    if model == "toy":
        toy = args.toy or default_toy()
        return (os.path.join(toy, "data-bin"), {"transformer": os.path.join(toy, "transformer", "checkpoint_best.pt"),
                                                "lstm": os.path.join(toy, "lstm", "checkpoint_best.pt")},
                args.subset, args.batch_size)
    return (os.path.join(args.m30k, "data-bin"), {"transformer": os.path.join(args.m30k, args.m30k_checkpoint)},
            "test", 64)


def decode_runs(args, model, device, fp16):
    """The fairseq-generate command lines of one decode step."""
    data_bin, checkpoints, subset, batch = model_files(args, model)
    runs = []
    for name, options, kind in METHODS:
        if (args.methods and name not in args.methods) or kind not in checkpoints:
            continue
        argv = [data_bin, "--path", checkpoints[kind], "--user-dir", os.path.join(REPO, "fairseq_stream"),
                "--gen-subset", subset, "--batch-size", str(batch), "--num-workers", "0",
                "--log-format", "simple"] + options
        argv += ["--fp16"] if fp16 else []
        argv += ["--cpu"] if device == "cpu" else []
        runs.append({"name": name, "argv": argv})
    return runs


def decode_step(session, args, model, device, fp16):
    """Decode every method; the step result holds each run's measurements."""
    def step():
        data_bin, checkpoints, _, _ = model_files(args, model)
        for path in [data_bin] + list(checkpoints.values()):
            if not os.path.exists(path):
                raise StepError("{} not found".format(path))
        runs = decode_runs(args, model, device, fp16)
        results = session.run_plan(step_name(model, device, fp16), runs, args.run_timeout, device)
        failed = [n for n, r in results.items() if r.get("error")]
        for r in results.values():
            if r.get("error") is None and not r.get("sentences"):
                r["error"] = "no 'Translated' line"
                failed.append(r["name"])
        return {"status": "failed" if failed else "passed",
                "detail": "{} of {} runs decoded{}".format(len(results) - len(failed), len(results),
                                                           "; failed: " + ", ".join(failed) if failed else ""),
                "runs": results, "model": model, "device": device, "fp16": fp16}
    return step


def step_name(model, device, fp16):
    if device == "cpu":
        return "decode-{}-cpu".format(model)
    return "decode-{}-cuda-{}".format(model, "fp16" if fp16 else "fp32")


def compare_step(session, args, models):
    """Every check of CHECKS on every device decode, against its reference run."""
    def step():
        steps = session.results["steps"]
        rows, failed, differ = [], 0, 0
        for model in models:
            cpu = steps.get(step_name(model, "cpu", False), {}).get("runs")
            device_steps = ([step_name(model, "cuda", fp16) for fp16 in (False, True)] if session.cuda
                            else [step_name(model, "cpu", False)])
            for name in device_steps:
                dev = steps.get(name, {}).get("runs")
                if dev is None:
                    continue
                fp16 = name.endswith("fp16")
                for kind, method, reference, where in CHECKS:
                    if where == "cpu" and not session.cuda:
                        continue  # on the CPU the reference is the run itself
                    ref_runs = cpu if where == "cpu" else dev
                    if ref_runs is None or method not in dev or reference not in ref_runs:
                        continue
                    if fp16 and kind != "near":
                        kind = "near"  # half precision promises no bitwise equality
                    row = compare(kind, dev[method], ref_runs[reference], fp16)
                    row.update(model=model, run=name, method=method,
                               reference="{} ({})".format(reference, "cpu" if where == "cpu" else "same run"))
                    rows.append(row)
                    failed += row["status"] == "failed"
                    differ += row["status"] == "differs"
        if not rows:
            raise StepError("nothing to compare: no decode step finished")
        return {"status": "failed" if failed else "passed",
                "detail": "{} checks: {} failed, {} within the floor but not identical".format(
                    len(rows), failed, differ), "checks": rows}
    return step


def compare(kind, run, reference, fp16):
    """One check: how many sentences' printed hypotheses differ."""
    ours, theirs = hypotheses(run.get("output")), hypotheses(reference.get("output"))
    if run.get("error") or reference.get("error") or ours is None or theirs is None:
        return {"kind": kind, "status": "failed", "sentences": None, "identical": None,
                "detail": "a run failed: " + (run.get("error") or reference.get("error") or "no output")}
    ids = sorted(set(ours) | set(theirs))
    with_scores = kind == "exact+scores"
    same = sum(i in ours and i in theirs and (ours[i] if with_scores else ours[i][1]) ==
               (theirs[i] if with_scores else theirs[i][1]) for i in ids)
    share = same / len(ids) if ids else 0.0
    floor = FLOOR_FP16 if fp16 else FLOOR_FP32
    if same == len(ids) and ids:
        status = "passed"
    elif kind.startswith("exact") or share < floor:
        status = "failed"
    else:
        status = "differs"
    first = next((i for i in ids if not (i in ours and i in theirs and ours[i][1] == theirs[i][1])), None)
    detail = "" if first is None else "first differing sentence {}".format(first)
    return {"kind": kind, "status": status, "sentences": len(ids), "identical": same,
            "floor": None if kind.startswith("exact") else floor, "detail": detail}


def setup_step(session, args):
    """The wheels a bare GPU machine lacks, installed into WORK/site (the later steps import from there)."""
    def step():
        if not args.wheels:
            return {"status": "skipped", "detail": "no --wheels: the interpreter's own packages"}
        site, count, note = install_wheels(session, args.wheels)
        return {"status": "passed", "detail": "{} files installed into {}{}".format(count, site, note)}
    return step


def build_step(session, args):
    """Build the extensions in place (CUDA where torch has it and nvcc is found); both must load."""
    def step():
        if not session.cuda:
            return {"status": "skipped", "detail": "no CUDA (--device cpu): CI compiles the CUDA sources with "
                                                   "scripts/check_cuda_compile.sh (tests/test_cuda_compile.py)"}
        env = dict(session.env, MAX_JOBS=str(os.cpu_count() or 4))
        rc, out = session.run_command([args.python, "setup.py", "build_ext", "--inplace"], "build", 480, env=env)
        if rc != 0:
            raise StepError("setup.py build_ext --inplace {}: {}".format(
                "timed out" if rc is None else "exit {}".format(rc), out.splitlines()[-1] if out else ""))
        rc, out = session.run_command([args.python, "-c", "import torch, fairseq_stream._ops_cpu, "
                                       "fairseq_stream._ops_cuda; print('both load')"], "build_load", 120)
        if rc != 0:
            raise StepError("built, but does not load: " + (out.splitlines()[-1] if out else ""))
        return {"status": "passed", "detail": "_ops_cpu and _ops_cuda built and load"}
    return step


def cuda_tests_step(session, args):
    """pytest -k cuda (names and markers), with the toy handed to the suite's fixture."""
    def step():
        if not session.cuda:
            return {"status": "skipped", "detail": "no CUDA (--device cpu): the CUDA tests skip without a GPU"}
        toy = os.path.abspath(args.toy or default_toy())
        # The suite finds its toy as CACHE/toy-<hash of the training scripts>; point one at ours.
        cache = tempfile.mkdtemp(prefix="toy-cache-", dir=session.work)
        os.symlink(toy, os.path.join(cache, "toy-" + load_toy_cache().toy_key()))
        env = dict(session.env, FAIRSEQ_STREAM_CACHE=cache)
        rc, out = session.run_command([args.python, "-m", "pytest", "tests", "-k", args.tests_k, "--ignore",
                                       "tests/test_cuda_compile.py", "-p", "no:cacheprovider", "-q", "-n", "0"],
                                      "cuda_tests", 540, env=env)
        summary = next((line for line in reversed(out.splitlines()) if re.search(r"\d+ (passed|failed)", line)),
                       "no pytest summary line")
        if rc is None:
            raise StepError("timed out; last: " + summary)
        if "skipped" in summary and "passed" not in summary:
            raise StepError("every CUDA test skipped: " + summary)
        return {"status": "passed" if rc == 0 else "failed", "detail": summary.strip("= ")}
    return step


def render(results):
    """summary.md: the steps, each decode's measurements, the checks."""
    lines = summary_head(results, "GPU check")
    cpu = results["device"] == "cpu"
    na = NA_CPU if cpu else "—"
    for name, s in results["steps"].items():
        if not s.get("runs"):
            continue
        lines += ["", "## " + name, "",
                  "| method | sentences | decode s | calls | rows/call | host ms/call | ms/call | GPU busy | "
                  "peak MiB | error |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
        for method, r in s["runs"].items():
            busy = r.get("gpu_busy")
            lines.append("| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |".format(
                method, fmt(r.get("sentences")), fmt(r.get("decode_s"), ".3f"), fmt(r.get("calls")),
                fmt(r.get("rows_per_call"), ".1f"), fmt(r.get("host_ms_per_call"), ".3f"),
                fmt(r.get("ms_per_call"), ".3f"), na if busy is None else "{:.0%}".format(busy),
                fmt(r.get("peak_mib"), ".0f", na), (r.get("error") or "").replace("|", "/")))
    checks = results["steps"].get("compare", {}).get("checks")
    if checks:
        lines += ["", "## Printed hypotheses compared", "",
                  "exact: every sentence's H- line text identical (+scores: the score column too); near: "
                  "identical except near ties, 'differs' above the floor, 'failed' below it.", "",
                  "| model | run | method | reference | kind | identical | status | detail |",
                  "| --- | --- | --- | --- | --- | ---: | --- | --- |"]
        for c in checks:
            lines.append("| {} | {} | {} | {} | {} | {}/{} | {} | {} |".format(
                c["model"], c["run"], c["method"], c["reference"], c["kind"], fmt(c["identical"]),
                fmt(c["sentences"]), c["status"], c.get("detail", "")))
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parser().parse_args(argv)
    absolute_paths(args, PATH_OPTIONS)  # the children run in the repository's root
    session = Session("gpu_check", args, render)
    session.step("setup", setup_step(session, args))
    session.step("environment", lambda: environment_step(session))
    session.step("build", build_step(session, args), needs_s=60)
    session.step("cuda-tests", cuda_tests_step(session, args), needs_s=60)
    models = ["toy"] + (["m30k"] if args.m30k else [])
    for model in models:
        session.step(step_name(model, "cpu", False), decode_step(session, args, model, "cpu", False), needs_s=20)
        if session.cuda:
            session.step(step_name(model, "cuda", False), decode_step(session, args, model, "cuda", False), needs_s=20)
            if args.no_fp16:
                session.step(step_name(model, "cuda", True), lambda: {"status": "skipped", "detail": "--no-fp16"})
            else:
                session.step(step_name(model, "cuda", True), decode_step(session, args, model, "cuda", True),
                             needs_s=20)
    if not args.m30k:
        session.step("decode-m30k", lambda: {"status": "skipped", "detail": "no --m30k DIR given"})
    session.step("compare", compare_step(session, args, models), needs_s=1)
    return session.finish()


if __name__ == "__main__":
    sys.exit(main())
