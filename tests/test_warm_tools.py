"""The suite's warm tool runs (tests/warm_tools.py) print and exit as fresh processes do."""

import os
import signal
import subprocess
import sys
import time

from conftest import REPO, run_tool, tool_env, warm_tools


def cold(argv, input=None):
    return subprocess.run([str(a) for a in argv], cwd=REPO, env=tool_env(), capture_output=True, text=True,
                          input=input)


def test_python_code_exits_reads_stdin_and_writes_both_streams_as_a_process():
    code = ("import sys; data = sys.stdin.read(); print(sys.argv[1:], repr(data)); "
            "print('to stderr', file=sys.stderr); sys.exit(int(sys.argv[1]))")
    for status in ("0", "3"):
        argv = [sys.executable, "-c", code, status, "x y"]
        warm, fresh = run_tool(argv, check=False, input="line 1\nline 2\n"), cold(argv, input="line 1\nline 2\n")
        assert (warm.returncode, warm.stdout, warm.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
        assert warm.returncode == int(status) and "'x y'" in warm.stdout
    raised = [sys.executable, "-c", "import os; print(os.getcwd()); raise ValueError('boom')"]
    warm, fresh = run_tool(raised, check=False), cold(raised)
    assert warm.returncode == fresh.returncode == 1 and warm.stdout == fresh.stdout == str(REPO) + "\n"
    assert warm.stderr.splitlines()[-1] == fresh.stderr.splitlines()[-1] == "ValueError: boom"


def test_fairseq_generate_prints_what_a_fresh_process_prints(toy):
    argv = [warm_tools_bin("fairseq-generate"), toy.data_bin, "--path", toy.transformer, "--user-dir",
            REPO / "fairseq_stream", "--gen-subset", "valid", "--batch-size", "64",
            "--search", "var-batch", "--beam", "3"]
    warm, fresh = run_tool(argv), cold(argv)
    lines = [line for line in fresh.stdout.splitlines() if line[:2] in ("S-", "T-", "H-", "D-", "P-")]
    assert len([line for line in lines if line.startswith("H-")]) == 200  # the toy's validation set
    assert [line for line in warm.stdout.splitlines() if line[:2] in ("S-", "T-", "H-", "D-", "P-")] == lines
    bad = argv + ["--no-such-option"]
    warm, fresh = run_tool(bad, check=False), cold(bad)
    assert warm.returncode == fresh.returncode != 0
    assert warm.stderr.splitlines()[-1] == fresh.stderr.splitlines()[-1]


def test_runs_with_an_environment_of_their_own_or_other_tools_are_not_warm():
    assert not warm_tools.warm_argv([sys.executable, "script.py"], warm_tools_bin("x").parent)
    assert not warm_tools.warm_argv([str(warm_tools_bin("fairseq-preprocess"))], warm_tools_bin("x").parent)
    assert warm_tools.warm_argv([str(warm_tools_bin("fairseq-interactive"))], warm_tools_bin("x").parent)
    proc = run_tool([sys.executable, "-c", "import os; print(os.environ['WARM_TOOLS_PROBE'])"],
                    env={"WARM_TOOLS_PROBE": "fresh"})
    assert proc.stdout == "fresh\n"


def warm_tools_bin(name):
    from pathlib import Path

    return Path(sys.executable).parent / name


def test_close_does_not_wait_for_a_forked_process_holding_the_servers_input():
    """A process this one forked (a --cpu-workers worker) holds the write end of the server's stdin: closing it
    was no end of input, and close() waited 30 s, then raised TimeoutExpired in an atexit hook."""
    server = warm_tools.Server(tool_env())
    assert server.run([sys.executable, "-c", "pass"], REPO).returncode == 0
    holder = os.fork()
    if holder == 0:  # the forked process: it holds every descriptor of this one, and sleeps
        time.sleep(60)
        os._exit(0)
    try:
        start = time.monotonic()
        server.close()
        assert time.monotonic() - start < 10
        assert server._proc.returncode == 0  # it quit when asked, not killed
    finally:
        os.kill(holder, signal.SIGKILL)
        os.waitpid(holder, 0)
