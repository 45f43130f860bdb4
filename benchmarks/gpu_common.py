"""What ``gpu_check.py`` and ``gpu_bench.py`` share: bounded steps, decode plans, the results files.

A run of either script is a list of *steps*. Each step has a time limit and
the whole run a deadline (``--deadline``, default 570 s: one 10-minute
command of a lent GPU machine); a step that does not fit is skipped and says
so, and a failing step is recorded and the run goes on. After every step
OUTDIR/results.json and OUTDIR/summary.md are written again, so a run killed
from outside still leaves what it measured. ``--resume results.json`` keeps
an earlier run's finished steps and runs the rest.

The driver itself imports only the standard library: it runs before the
environment step has installed anything, and every model is loaded in a
child process (``gpu_probe.py``) that it can kill.
"""

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from collections import OrderedDict

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
NA_CPU = "n/a (cpu)"
DEFAULT_DEADLINE_S = 570


class StepError(Exception):
    """A step failed; the message is its one-line reason."""


def now():
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def commit_of(given=None):
    """The commit being measured: ``--commit``, else git's HEAD (plus '+changes' for a dirty tree)."""
    if given:
        return given
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, timeout=20)
        if head.returncode != 0:
            return "unknown (no git repository here; pass --commit)"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=20).stdout.strip()
        return head.stdout.strip() + ("+changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown (git not found; pass --commit)"


def write_json(path, data):
    """Write JSON atomically."""
    tmp = "{}.tmp{}".format(path, os.getpid())
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
        f.write("\n")
    os.replace(tmp, path)


def fmt(value, spec="", na="—"):
    """A number for a table; ``na`` for a missing one."""
    if value is None:
        return na
    return format(value, spec) if spec else str(value)


def add_common_arguments(parser, deadline=DEFAULT_DEADLINE_S):
    """The options both scripts take."""
    parser.add_argument("outdir", metavar="OUTDIR", help="results.json, summary.md and details.tar.gz go here")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (default): the real check; cpu: the same steps on the CPU with tiny inputs "
                             "(CI), GPU-only figures reported as '{}'".format(NA_CPU))
    parser.add_argument("--work-dir", metavar="DIR",
                        help="scratch: logs, hypotheses, installed wheels, the stand-in (default: "
                             "$TMPDIR/fairseq-stream-gpu/SCRIPT, outside OUTDIR: a lent machine sends back only "
                             "8 files of OUTDIR; details.tar.gz holds the logs and hypotheses)")
    parser.add_argument("--wheels", metavar="DIR",
                        help="install every wheel (and sdist) in DIR with pip --no-index into WORK/site first "
                             "(a GPU machine without fairseq; scripts/gpu_wheels.sh fetches them)")
    parser.add_argument("--deadline", type=float, default=deadline, metavar="S",
                        help="seconds for the whole run; steps that no longer fit are skipped "
                             "(default %(default)s: one 10-minute command)")
    parser.add_argument("--steps", nargs="+", metavar="STEP", help="run only these steps (default: all)")
    parser.add_argument("--resume", metavar="RESULTS.json",
                        help="keep the steps an earlier run finished (passed or failed) and run the others")
    parser.add_argument("--commit", help="the commit measured (default: git's HEAD; a copy without .git "
                                         "cannot know it)")
    parser.add_argument("--python", default=sys.executable,
                        help="the interpreter for the child processes (default: this one)")


class Session:
    """One run of a script: its steps, their results, the files in OUTDIR."""

    def __init__(self, script, args, render):
        self.args, self.render = args, render
        self.outdir = os.path.abspath(args.outdir)
        self.work = os.path.abspath(args.work_dir or os.path.join(tempfile.gettempdir(), "fairseq-stream-gpu", script))
        os.makedirs(self.work, exist_ok=True)
        self.logs = os.path.join(self.work, "logs")
        os.makedirs(self.logs, exist_ok=True)
        self.start = time.monotonic()
        self.cuda = args.device == "cuda"
        earlier = {}
        if args.resume:
            try:
                with open(args.resume) as f:
                    earlier = json.load(f)
            except (OSError, ValueError) as e:
                sys.exit("{}: error: --resume {}: {}".format(script, args.resume, getattr(e, "strerror", None) or e))
        self.earlier = {k: v for k, v in earlier.get("steps", {}).items() if v.get("status") in ("passed", "failed")}
        self.results = OrderedDict(
            script=script, device=args.device, commit=commit_of(args.commit), started=now(), finished=None,
            host=platform.node(), argv=sys.argv[1:], steps=OrderedDict())
        for key in ("environment", "data_bin", "behaviour_data_bin", "behaviour"):  # what later steps read
            if key in earlier:
                self.results[key] = earlier[key]
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in [self.env.get("PYTHONPATH")] if p])
        self.env["PYTHONUNBUFFERED"] = "1"
        if not self.cuda:
            # The CPU mode is CI's, on a small shared machine: one thread each, as the test suite runs.
            self.env.setdefault("OMP_NUM_THREADS", "1")
            self.env.setdefault("MKL_NUM_THREADS", "1")

    # -- time --------------------------------------------------------------

    def left(self):
        """Seconds left before the deadline."""
        return self.args.deadline - (time.monotonic() - self.start)

    # -- steps -------------------------------------------------------------

    def wanted(self, name):
        return not self.args.steps or name in self.args.steps

    def step(self, name, fn, needs_s=5.0):
        """Run step ``name`` (``fn()`` returns a dict with status and detail) unless it is not wanted or
        does not fit; record its result and rewrite the output files. Returns the result."""
        if name in self.earlier and not (self.args.steps and name in self.args.steps):
            result = dict(self.earlier[name], resumed=True)
        elif not self.wanted(name):
            result = {"status": "skipped", "detail": "not in --steps"}
        elif self.left() < needs_s:
            result = {"status": "skipped", "detail": "out of time ({:.0f} s of --deadline left, needs about "
                      "{:.0f}); run it alone: --steps {} --resume OUTDIR/results.json".format(
                          max(self.left(), 0), needs_s, name)}
        else:
            print("== {}: {}".format(self.results["script"], name), file=sys.stderr, flush=True)
            t0 = time.monotonic()
            try:
                result = fn()
            except StepError as e:
                result = {"status": "failed", "detail": str(e)}
            except Exception as e:  # the driver's own bug in one step must not cost the others
                result = {"status": "failed", "detail": "{}: {}".format(type(e).__name__, e),
                          "traceback": traceback.format_exc()}
            result["seconds"] = round(time.monotonic() - t0, 1)
            result["finished"] = now()
        self.results["steps"][name] = result
        self.save()
        print("== {}: {}: {} ({})".format(self.results["script"], name, result["status"], result.get("detail", "")),
              file=sys.stderr, flush=True)
        return result

    def save(self, final=False):
        """results.json and summary.md now; with ``final``, details.tar.gz too."""
        if final:
            self.results["finished"] = now()
        os.makedirs(self.outdir, exist_ok=True)
        write_json(os.path.join(self.outdir, "results.json"), self.results)
        with open(os.path.join(self.outdir, "summary.md"), "w", encoding="utf-8") as f:
            f.write(self.render(self.results))
        if final:
            self.archive()

    def finish(self) -> int:
        """Save everything, say where the summary is in one line; the exit status (1: a step failed)."""
        self.save(final=True)
        failed = [n for n, s in self.results["steps"].items() if s["status"] == "failed"]
        print("{}: {} steps, {} failed{}; {}".format(
            self.results["script"], len(self.results["steps"]), len(failed),
            " (" + ", ".join(failed) + ")" if failed else "", os.path.join(self.outdir, "summary.md")))
        # A step name that matched none (a typo) left every step skipped and the run "passed".
        unknown = [n for n in self.args.steps or () if n not in self.results["steps"]]
        if unknown:
            print("{}: error: --steps {}: no such step (the steps: {})".format(
                self.results["script"], " ".join(unknown), " ".join(self.results["steps"])), file=sys.stderr)
            return 2
        return 1 if failed else 0

    def archive(self):
        """details.tar.gz: the logs, the probe's per-run JSON and the hypotheses (small: text only)."""
        path = os.path.join(self.outdir, "details.tar.gz")
        with tarfile.open(path + ".tmp", "w:gz") as tar:
            for root, dirs, files in os.walk(self.work):
                dirs[:] = [d for d in dirs if d not in ("site", "prepared", "standin", "pycache", "__pycache__")]
                for name in files:
                    full = os.path.join(root, name)
                    if name.endswith((".log", ".json", ".txt", ".md", ".jsonl", ".hyp")) and \
                            os.path.getsize(full) < 20 * 2 ** 20:
                        tar.add(full, arcname=os.path.relpath(full, self.work))
        os.replace(path + ".tmp", path)

    # -- child processes ---------------------------------------------------

    def run_command(self, argv, name, timeout, env=None):
        """Run ``argv`` with its output in logs/NAME.log, bounded by ``timeout`` and the deadline.

        Returns (exit code or None when it was killed for time, the log's last lines)."""
        log = os.path.join(self.logs, name + ".log")
        limit = max(1.0, min(timeout, self.left()))
        with open(log, "w") as f:
            f.write("$ {}\n".format(" ".join(shlex.quote(str(a)) for a in argv)))
            f.flush()
            proc = subprocess.Popen([str(a) for a in argv], cwd=REPO, env=env or self.env, stdout=f,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                kill(proc)
                rc = None
        return rc, tail(log)

    def run_plan(self, name, runs, run_timeout, device, keep_models=False, warm_up=False, profile=None):
        """Decode every run of ``runs`` (dicts with name and argv) with gpu_probe.py; {name: result}.

        ``keep_models``: the probe loads each checkpoint list once and keeps it
        for the later runs (gpu_probe.KeptModels); a probe started again after
        a crash loads them anew. ``warm_up``: each run decodes twice, the
        second measured (gpu_probe's ``cold_decode_s``). ``profile``: {"first",
        "calls"}, the warm-up decode's calls torch.profiler records (gpu_probe's
        ``kernels``).

        One probe process decodes them in order. A run that kills it (a crash)
        or takes longer than ``run_timeout`` is recorded as failed and the probe
        is started again for the runs after it, while the deadline allows."""
        plan_dir = os.path.join(self.work, name)
        os.makedirs(plan_dir, exist_ok=True)
        for run in runs:
            run["results"] = os.path.join(plan_dir, run["name"])
            run["result"] = os.path.join(plan_dir, run["name"] + ".json")
            if os.path.exists(run["result"]):
                os.remove(run["result"])  # a result is this run's, never a stale one
        plan_path = os.path.join(plan_dir, "plan.json")
        write_json(plan_path, {"device": device, "runs": runs, "keep_models": keep_models, "warm_up": warm_up,
                               "profile": profile})
        launches = 0
        while True:
            todo = [r for r in runs if not os.path.exists(r["result"])]
            if not todo:
                break
            if self.left() < 5:
                for r in todo:
                    write_json(r["result"], {"name": r["name"], "error": "not run: out of time (--deadline)"})
                break
            launches += 1
            log = os.path.join(self.logs, "{}.probe{}.log".format(name, launches))
            current = plan_path + ".current"
            if os.path.exists(current):
                os.remove(current)
            with open(log, "w") as f:
                proc = subprocess.Popen([self.args.python, os.path.join(HERE, "gpu_probe.py"), plan_path], cwd=REPO,
                                        env=self.env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
                why = watch(proc, todo, current, run_timeout, self.left)
            if why is not None:
                stuck = read_text(current)
                victim = next((r for r in todo if r["name"] == stuck), todo[0])
                if not os.path.exists(victim["result"]):
                    write_json(victim["result"], {"name": victim["name"], "error": "{} (log: {})".format(
                        why, os.path.relpath(log, self.work)), "log_tail": tail(log)})
        out = OrderedDict()
        for r in runs:
            with open(r["result"]) as f:
                out[r["name"]] = json.load(f)
            out[r["name"]]["output"] = os.path.join(r["results"], "generate-test.txt")
        return out


def watch(proc, todo, current, run_timeout, left):
    """Wait for the probe; None when it ended normally, else why it was stopped or died."""
    last_progress, done = time.monotonic(), sum(os.path.exists(r["result"]) for r in todo)
    while True:
        try:
            rc = proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            rc = None
        if rc is not None:
            return None if rc == 0 else "the probe process exited with status {}".format(rc)
        finished = sum(os.path.exists(r["result"]) for r in todo)
        if finished != done:
            last_progress, done = time.monotonic(), finished
        if time.monotonic() - last_progress > run_timeout:
            kill(proc)
            return "timed out after {:.0f} s (--run-timeout)".format(run_timeout)
        if left() < 1:
            kill(proc)
            return "stopped: out of time (--deadline)"


def kill(proc):
    """End a child and everything it started (its own process group)."""
    try:
        os.killpg(proc.pid, 9)
    except OSError:
        pass
    proc.wait()


def read_text(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def tail(path, lines=15, width=300):
    """The last lines of a log, long lines cut (fairseq logs its whole config on one line)."""
    try:
        with open(path, errors="replace") as f:
            text = f.read().rstrip("\n").split("\n")
    except OSError:
        return ""
    return "\n".join(line if width is None or len(line) <= width else line[:width] + " [...]"
                     for line in text[-lines:])


def hypotheses(path):
    """fairseq-generate's H- lines of an output file: {sentence id: (score, text)}; None if it is missing."""
    if not path or not os.path.exists(path):
        return None
    hyps = {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith("H-"):
                head, score, text = (line.rstrip("\n").split("\t") + ["", ""])[:3]
                hyps[int(head[2:])] = (score, text)
    return hyps


def install_wheels(session, wheels):
    """pip-install the wheels in ``wheels``, then its sdists, into WORK/site (no index, no dependencies).

    Returns (site, files installed, a note on sdists that did not build). The later steps' children
    import from there. An sdist that does not build (fastBPE, needed only by gpu_bench's prepare)
    is a note, not a failure: the wheels are what every step needs."""
    site = os.path.join(session.work, "site")
    wheels = os.path.abspath(wheels)
    names = sorted(os.listdir(wheels))
    binaries = [os.path.join(wheels, f) for f in names if f.endswith(".whl")]
    sources = [os.path.join(wheels, f) for f in names if f.endswith((".tar.gz", ".zip"))]
    if not binaries:
        raise StepError("--wheels {}: no .whl files there (scripts/gpu_wheels.sh fetches them)".format(wheels))
    pip = [session.args.python, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile", "--upgrade",
           "--target", site]
    rc, out = session.run_command(pip + binaries, "pip_install_wheels", 300)
    if rc != 0:
        raise StepError("pip install --target {} failed ({}): {}".format(
            site, "timed out" if rc is None else "exit {}".format(rc), out.splitlines()[-1] if out else ""))
    note = ""
    if sources:
        # sdists build against the interpreter's own cython and numpy: no build isolation.
        rc, out = session.run_command(pip + ["--no-build-isolation"] + sources, "pip_install_sdists", 300)
        if rc != 0:
            note = "; the sdists did not build ({}): {}".format(
                "timed out" if rc is None else "exit {}".format(rc), out.splitlines()[-1] if out else "")
    session.env["PYTHONPATH"] = os.pathsep.join([REPO, site] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return site, len(binaries) + (len(sources) if not note else 0), note


def environment_step(session, extra_modules=()):
    """Versions of what the run uses, and whether the device is there; fails without torch or fairseq."""
    code = r"""
import json, platform, sys
info = {"python": sys.version.split()[0], "platform": platform.platform()}
try:
    import torch
    info["torch"] = torch.__version__
    info["torch_cuda"] = torch.version.cuda
    info["cuda_available"] = torch.cuda.is_available()
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        p = torch.cuda.get_device_properties(0)
        info["gpu_memory_gib"] = round(p.total_memory / 2 ** 30, 1)
        info["capability"] = "{}.{}".format(p.major, p.minor)
except Exception as e:
    info["torch"] = "not importable: {}".format(e)
import importlib.metadata, importlib.util
for name in ["fairseq", "pynvml"] + sys.argv[1:]:
    # Found, not imported: importing fairseq costs seconds, and the decode steps import it anyway.
    if importlib.util.find_spec(name) is None:
        info[name] = "not importable: not installed"
        continue
    dist = {"fairseq": "fairseq-fixed", "pynvml": "nvidia-ml-py", "subword_nmt": "subword-nmt"}.get(name, name)
    try:
        info[name] = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        info[name] = "found"
for name in ("fairseq_stream._ops_cpu", "fairseq_stream._ops_cuda"):
    try:
        __import__(name)
        info[name] = "loads"
    except Exception as e:
        info[name] = "does not load: {}".format(e)
print(json.dumps(info))
"""
    rc, out = session.run_command([session.args.python, "-c", code] + list(extra_modules), "environment", 120)
    try:
        info = json.loads(tail(os.path.join(session.logs, "environment.log"), lines=1, width=None))
    except (ValueError, IndexError):
        raise StepError("could not read the environment (exit {}): {}".format(rc, out[-300:]))
    try:
        nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, timeout=30)
        info["nvcc"] = nvcc.stdout.strip().splitlines()[-1] if nvcc.returncode == 0 else "not found"
    except (OSError, subprocess.SubprocessError):
        info["nvcc"] = "not found"
    session.results["environment"] = info
    problems = []
    if not str(info.get("torch", "")).split("+")[0][:1].isdigit():
        problems.append("torch " + str(info.get("torch")))
    if "not importable" in str(info.get("fairseq")):
        problems.append("fairseq " + str(info.get("fairseq")) + " (give --wheels DIR)")
    if session.cuda and not info.get("cuda_available"):
        problems.append("--device cuda but torch sees no CUDA device")
    status = "failed" if problems else "passed"
    detail = "; ".join(problems) if problems else "torch {}, {}".format(
        info.get("torch"), info.get("gpu") or "cpu")
    return {"status": status, "detail": detail, "info": info}


def summary_head(results, title):
    """summary.md's first lines: the title, commit, times and host, the environment, and the steps' table."""
    lines = ["# {} ({})".format(title, results["device"]), "",
             "commit {}, started {}, finished {}, host {}".format(results["commit"], results["started"],
                                                                 results["finished"] or "(running)",
                                                                 results["host"]), ""]
    env = results.get("environment")
    if env:
        lines += ["Environment: " + ", ".join("{} {}".format(k, v) for k, v in env.items()), ""]
    lines += ["| step | status | seconds | detail |", "| --- | --- | ---: | --- |"]
    for name, s in results["steps"].items():
        lines.append("| {} | {} | {} | {} |".format(name, s["status"], fmt(s.get("seconds")),
                                                    s.get("detail", "").replace("|", "/")))
    return lines


def absolute_paths(args, names):
    """Make the path options ``names`` of ``args`` absolute (one path or a list of them), in place."""
    for name in names:
        value = getattr(args, name)
        if value:
            setattr(args, name, [os.path.abspath(v) for v in value] if isinstance(value, list) else os.path.abspath(value))
