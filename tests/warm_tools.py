"""fairseq-generate and fairseq-interactive for the tests, forked from a process that has already imported fairseq.

Why. A toy fairseq-generate takes about 6 s, 5 of them importing torch,
fairseq (every task, model and criterion it registers, scikit-learn
among them) and composing its configuration; the suite runs a few hundred
of them, and CI has two cores. Each test worker starts one server here:
a Python process that imports fairseq once and then, for each run, forks
a child that runs the tool's own script (``bin/fairseq-generate``) or
``python -c`` code with the run's argv, working directory and stdin, its
stdout and stderr written to files. The child is a real process with the
tool's code path from ``__main__`` on: only the imports were done before
the fork. The server imports neither fairseq_stream (a child imports it
through ``--user-dir``, so plain-fairseq reference runs stay plain) nor
anything that configures logging, and computes nothing, so no thread pool
exists to be broken by the fork.

What still runs as a fresh subprocess (conftest.run_tool decides): every
run with an environment of its own (thread counts, ATEN_CPU_CAPABILITY,
our variables are read at import or first use), every other tool, and
everything when FAIRSEQ_STREAM_WARM_TOOLS=0.
"""

import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

# Console scripts of the venv run warm (their scripts are run as __main__ in the child).
WARM_SCRIPTS = ("fairseq-generate", "fairseq-interactive")
# What the server imports before it forks: the expensive part of every tool's start.
_PRELOAD = ("torch", "fairseq", "fairseq.options", "fairseq.tasks", "fairseq.models", "fairseq.criterions",
            "fairseq.checkpoint_utils", "fairseq.sequence_generator", "fairseq_cli.generate")


def enabled() -> bool:
    return os.environ.get("FAIRSEQ_STREAM_WARM_TOOLS", "1") != "0"


class Server:
    """One forking server (a child process of this test worker) and the lock that keeps its runs one at a time."""

    def __init__(self, env):
        self._lock = threading.Lock()
        self._log = tempfile.NamedTemporaryFile(prefix="warm-tools-", suffix=".log", delete=False)
        self._proc = subprocess.Popen([sys.executable, __file__, "--serve"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._log, env=env, cwd="/")

    def run(self, argv, cwd, input=None):
        """``argv`` run in a forked child: a CompletedProcess (text), or None when the server is gone."""
        with self._lock, tempfile.TemporaryDirectory(prefix="warm-run-") as tmp:
            tmp = Path(tmp)
            stdin = os.devnull
            if input is not None:
                stdin = tmp / "stdin"
                stdin.write_text(input)
            request = {"argv": argv, "cwd": str(cwd), "stdin": str(stdin),
                       "stdout": str(tmp / "stdout"), "stderr": str(tmp / "stderr")}
            try:
                self._proc.stdin.write((json.dumps(request) + "\n").encode())
                self._proc.stdin.flush()
                answer = self._proc.stdout.readline()
            except (BrokenPipeError, OSError):
                return None
            if not answer:
                return None
            returncode = json.loads(answer)["returncode"]
            return subprocess.CompletedProcess(argv, returncode, (tmp / "stdout").read_text(),
                                               (tmp / "stderr").read_text())

    def close(self):
        """Ask the server to quit, and wait for it (killed if it does not go within 30 s).

        The server is asked in words, not by closing its stdin: a process this
        test worker forked (a --cpu-workers worker of an in-process run) holds
        a copy of the pipe's write end, so the server would not see the end of
        its input while such a process lives.
        """
        if self._proc.poll() is None:
            try:
                self._proc.stdin.write(b'{"quit": true}\n')
                self._proc.stdin.close()
            except (BrokenPipeError, OSError):
                pass
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        os.unlink(self._log.name)


_server = None


def run(argv, cwd, env, input=None):
    """``argv`` run warm where it may be (see the module's text); None where it must run as a fresh process."""
    global _server
    if not enabled():
        return None
    if _server is None:
        import atexit

        _server = Server(env)
        atexit.register(_server.close)
    return _server.run(argv, cwd, input)


def warm_argv(argv, bin_dir) -> bool:
    """Whether ``argv`` is a warm tool: a WARM_SCRIPTS script of ``bin_dir``, or this Python's ``-c CODE``."""
    head = Path(argv[0])
    if head.parent == Path(bin_dir) and head.name in WARM_SCRIPTS:
        return True
    return argv[0] == sys.executable and len(argv) >= 2 and argv[1] == "-c"


# ---- the server (runs as ``python warm_tools.py --serve``) ----

def _serve():
    import importlib

    for name in _PRELOAD:
        importlib.import_module(name)
    requests, answers = os.dup(0), os.dup(1)
    pending = b""
    while True:
        while b"\n" not in pending:
            chunk = os.read(requests, 65536)
            if not chunk:
                return
            pending += chunk
        line, pending = pending.split(b"\n", 1)
        request = json.loads(line)
        if request.get("quit"):
            return
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.close(requests)
            os.close(answers)
            _become(request)  # never returns: the child's exit is the run's
        _, status = os.waitpid(pid, 0)
        os.write(answers, (json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n").encode())


def _become(request):
    """In the forked child: the run's stdio, directory and argv, then its script or code as ``__main__``."""
    import types

    for fd, path, flags in ((0, request["stdin"], os.O_RDONLY),
                            (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    os.chdir(request["cwd"])
    argv = request["argv"]
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    if argv[1:2] == ["-c"]:
        sys.argv = ["-c"] + argv[3:]
        sys.path[0] = ""
        code = compile(argv[2], "<string>", "exec")
    else:
        sys.argv = list(argv)
        sys.path[0] = str(Path(argv[0]).parent)
        # The script's module stays __main__ to the end, as in a fresh process (runpy.run_path puts the
        # server's back before an uncaught error reaches sys.excepthook, which asks what tool this is).
        main.__file__ = argv[0]
        code = compile(Path(argv[0]).read_text(), argv[0], "exec")
    exec(code, main.__dict__)
    sys.exit(0)


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    _serve()
