"""Every shell and Python example in README.md and docs/*.md runs as printed.

The convention (also in docs/README.md, "Examples in these pages"): an example
is a fenced block whose info string is ``bash``, ``sh``, ``shell``,
``console`` or ``python``. The last non-blank line before its opening fence
must be one of

    <!-- example: run -->            the test runs it
    <!-- example: skip: REASON -->   the test does not run it; REASON says why
                                     (it needs a GPU, the network, the WMT'19 or
                                     the Multi30k models, or it is a synopsis)

An example without either comment fails ``test_every_example_is_marked``.
Program output is fenced as ``text`` and is not an example.

How a ``run`` example runs: in a fresh folder that looks like the repository
root after the quickstart (``fairseq_stream/``, ``scripts/`` and
``benchmarks/`` linked from the repository, ``toy/`` linked to the toy
checkpoints of tests/conftest.py), with this venv's tools first on PATH and one
thread. All of them run in one Python process, one after the other, so that
torch and fairseq are imported once (the whole test takes about as long as a
few fairseq-generate runs, not one per example):

* a Python block is executed as a script (``__name__ == "__main__"``);
* a shell block runs in ``bash -e -o pipefail`` exactly as printed, except
  that the console scripts ``fairseq-generate``, ``fairseq-interactive``,
  ``fairseq-stream-generate``, ``fairseq-stream-interactive`` and
  ``fairseq-stream-bulk`` are shell functions that record their arguments and
  standard input; when the block has finished, each recorded call runs in
  this process through the same entry point its console script calls, with
  that ``sys.argv`` and standard input (``fairseq-stream-user-dir`` prints
  what the real one prints). Everything else (``scripts/newstest.sh``,
  ``head``, ...) runs for real.

An example fails if it raises, exits non-zero, or a recorded call does.
docs/HISTORY.md (the record of past benchmark runs, whose commands need the
Multi30k model) and docs/GPU.md (GPU work, tested by its own tests) are not
scanned.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, tool_env

FENCE_RE = re.compile(r"^```(?P<info>[^\n`]*)\n(?P<body>.*?)^```[ \t]*$", re.M | re.S)
MARK_RE = re.compile(r"<!-- example: (?P<kind>run|skip)(?:: (?P<reason>[^\n]*?))? -->\s*$")
LANGUAGES = {"bash": "shell", "sh": "shell", "shell": "shell", "console": "shell", "python": "python"}
NOT_SCANNED = {"HISTORY.md", "GPU.md"}


def documents():
    docs = sorted(p for p in (REPO / "docs").glob("*.md") if p.name not in NOT_SCANNED)
    return [REPO / "README.md"] + docs


def examples():
    """(document, line, language, mark, reason, code) for every example block."""
    found = []
    for doc in documents():
        text = doc.read_text(encoding="utf-8")
        for match in FENCE_RE.finditer(text):
            info = match.group("info").strip().split()
            language = LANGUAGES.get(info[0]) if info else None
            if language is None:
                continue
            before = text[:match.start()].rstrip().splitlines()
            mark = MARK_RE.search(before[-1]) if before else None
            line = text.count("\n", 0, match.start()) + 1
            found.append((doc, line, language, mark.group("kind") if mark else None,
                          (mark.group("reason") or "") if mark else "", match.group("body")))
    return found


EXAMPLES = examples()


def example_id(example):
    return "{}:{}".format(os.path.relpath(example[0], REPO), example[1])


def test_every_example_is_marked():
    unmarked = [example_id(e) for e in EXAMPLES if e[3] is None]
    assert not unmarked, ("examples without '<!-- example: run -->' or '<!-- example: skip: REASON -->' "
                          "on the line before: {}".format(unmarked))
    no_reason = [example_id(e) for e in EXAMPLES if e[3] == "skip" and len(e[4].strip()) < 10]
    assert not no_reason, "skipped examples must say why: {}".format(no_reason)


def test_the_readme_shows_each_way_of_using_it():
    """The README's "How to use it" has a running example of each way to use the plugin."""
    readme = [e for e in EXAMPLES if e[0].name == "README.md" and e[3] == "run"]
    code = "\n".join(e[5] for e in readme)
    for tool in ("fairseq-generate ", "fairseq-interactive ", "fairseq-stream-generate ", "Translator(",
                 "--preset ", "fairseq-stream-bulk translate"):
        assert tool in code, tool


@pytest.fixture(scope="module")
def workdir(toy, tmp_path_factory):
    """A folder laid out like the repository root after the quickstart: fairseq_stream/, scripts/, toy/."""
    root = tmp_path_factory.mktemp("doc-examples")
    for name in ("fairseq_stream", "scripts", "benchmarks"):
        (root / name).symlink_to(REPO / name, target_is_directory=True)
    (root / "toy").symlink_to(toy.root, target_is_directory=True)
    return root


RUN = [e for e in EXAMPLES if e[3] == "run"]
TOOLS = ("fairseq-generate", "fairseq-interactive", "fairseq-stream-generate", "fairseq-stream-interactive",
         "fairseq-stream-bulk")


def test_examples_run_as_printed(workdir, tmp_path):
    spec = [{"id": example_id(e), "language": e[2], "code": e[5]} for e in RUN]
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = tool_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(workdir), str(Path(__file__).parent),
                                                       env.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, __file__, str(tmp_path)], cwd=workdir, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=900)
    results_file = tmp_path / "results.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else []
    assert proc.returncode == 0 and len(results) == len(spec), "the example runner failed:\n{}\n{}".format(
        proc.stdout[-3000:], proc.stderr[-3000:])
    print("seconds per example:", ", ".join("{} {}".format(r["id"], r["seconds"]) for r in results))
    failed = [r for r in results if not r["ok"]]
    report = []
    for r in failed:
        example = next(s for s in spec if s["id"] == r["id"])
        report.append("{} does not run as printed: {}\n{}\n--- its output (tail) ---\n{}".format(
            r["id"], r["error"], example["code"], r["output"][-4000:]))
    assert not failed, "\n\n".join(report)


# ----------------------------------------------------------------------------- the runner (a subprocess)


def _run_tool(argv, stdin):
    """Run a recorded console-script call in this process: its entry point, argv and stdin."""
    import io
    from importlib.metadata import entry_points

    (entry,) = [e for e in entry_points(group="console_scripts") if e.name == argv[0]]
    saved = sys.argv, sys.stdin
    sys.argv = list(argv)
    sys.stdin = io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8")
    try:
        entry.load()()
    except SystemExit as e:
        if e.code not in (None, 0):
            raise RuntimeError("{} exited with {}".format(argv[0], e.code))
    finally:
        sys.argv, sys.stdin = saved


def _run_shell(code, calls_dir):
    from fairseq_stream.cli import plugin_dir

    shims = ["__record() {",
             '  local n=$(( $(ls "$__CALLS" | grep -c "argv$" || true) + 1 ))',
             '  printf "%s\\0" "$@" > "$__CALLS/$n.argv"; cat > "$__CALLS/$n.stdin"',
             "}"]
    shims += ['{0}() {{ __record {0} "$@"; }}'.format(tool) for tool in TOOLS]
    shims += ["fairseq-stream-user-dir() {{ printf '%s\\n' '{}'; }}".format(plugin_dir())]
    env = dict(os.environ, __CALLS=str(calls_dir))
    proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", "\n".join(shims) + "\n" + code], env=env,
                          stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise RuntimeError("bash exited with {}".format(proc.returncode))
    calls = sorted(calls_dir.glob("*.argv"), key=lambda p: int(p.name.split(".")[0]))
    for argv_file in calls:
        argv = argv_file.read_bytes().split(b"\0")[:-1]
        stdin = argv_file.with_suffix(".stdin").read_bytes()
        _run_tool([a.decode() for a in argv], stdin)


def _runner(folder):
    """Run every example of spec.json; write results.json (id, ok, error, output) after each."""
    import time
    import traceback

    folder = Path(folder)
    spec = json.loads((folder / "spec.json").read_text())
    results = []
    for n, example in enumerate(spec):
        log = folder / "{}.log".format(n)
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        with open(log, "wb") as f:
            os.dup2(f.fileno(), 1)
            os.dup2(f.fileno(), 2)
        ok, error, start = True, "", time.monotonic()
        try:
            if example["language"] == "python":
                exec(compile(example["code"], example["id"], "exec"), {"__name__": "__main__"})
            else:
                calls = folder / "calls{}".format(n)
                calls.mkdir()
                _run_shell(example["code"], calls)
        except SystemExit as e:
            ok, error = e.code in (None, 0), "exit status {}".format(e.code)
        except BaseException as e:  # noqa: B036  (report anything, then go on)
            ok, error = False, "{}: {}".format(type(e).__name__, e)
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        results.append({"id": example["id"], "ok": ok, "error": error, "seconds": round(time.monotonic() - start, 1),
                        "output": log.read_text(errors="replace")})
        (folder / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    _runner(sys.argv[1])
