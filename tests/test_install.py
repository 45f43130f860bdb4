"""A kernel build that is missing or fails is loud: at install (setup.py) and at run time (one log line).

pip shows a successful build's output only with -v, so setup.py stops the
install when the compiled CPU kernels cannot be built (FAIRSEQ_STREAM_NO_KERNELS=1
installs without them on purpose), and a process that runs without them says
once what is slow and how to build them.
"""

import logging
import os
import stat
import sys

import pytest

from conftest import REPO, load_setup, run_tool


@pytest.fixture(scope="module")
def setup_module():
    """setup.py imported as a module (its setup() call runs only as __main__)."""
    return load_setup()


def run_setup(argv, env=None, prelude=""):
    """``python setup.py ARGV`` in this venv, after ``prelude`` (Python run first in the same process)."""
    code = "import runpy, sys; sys.argv = ['setup.py'] + {!r}; {}\nrunpy.run_path('setup.py', run_name='__main__')"
    return run_tool([sys.executable, "-c", code.format([str(a) for a in argv], prelude)], cwd=REPO, check=False,
                    env=env)


def test_torch_hidden_from_the_build_stops_the_install_with_the_cure():
    """What plain `pip install -e .` (build isolation) does: torch is not importable where setup.py runs."""
    proc = run_setup(["--name"], prelude="sys.modules['torch'] = None")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "fairseq-stream: cannot build the compiled kernels: torch is not importable by this build" in proc.stderr
    assert "pip install --no-build-isolation -e ." in proc.stderr and "FAIRSEQ_STREAM_NO_KERNELS=1" in proc.stderr
    opted_out = run_setup(["--name"], env={"FAIRSEQ_STREAM_NO_KERNELS": "1"}, prelude="sys.modules['torch'] = None")
    assert opted_out.returncode == 0 and opted_out.stdout.strip() == "fairseq-stream"
    assert "installing without the compiled kernels" in opted_out.stderr


def test_a_compiler_failure_stops_the_install(tmp_path):
    """A real build_ext with a compiler that fails: no silent torch-only install."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    for name in ("c++", "g++", "gcc", "cc"):
        tool = fake_bin / name
        tool.write_text("#!/bin/sh\necho 'fake compiler: cannot compile' >&2\nexit 1\n")
        tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    env = {"PATH": "{}{}{}".format(fake_bin, os.pathsep, os.environ["PATH"]), "CC": "gcc", "CXX": "g++",
           "MAX_JOBS": "1"}
    proc = run_setup(["build_ext", "--build-lib", tmp_path / "lib", "--build-temp", tmp_path / "temp"], env=env)
    assert proc.returncode != 0
    assert "fairseq-stream: building the compiled kernel fairseq_stream._ops_cpu failed" in proc.stderr
    assert "pip install --no-build-isolation -e ." in proc.stderr
    assert not list((tmp_path / "lib").rglob("*.so")) if (tmp_path / "lib").exists() else True


def test_a_failed_kernel_is_skipped_only_on_request(setup_module, monkeypatch, capsys):
    class FailingBuild:
        def build_extension(self, ext):
            raise RuntimeError("error: command 'g++' failed with exit code 1")

    command = setup_module.kernel_build_command(FailingBuild)()
    ext = type("Ext", (), {"name": "fairseq_stream._ops_cpu"})()
    monkeypatch.delenv("FAIRSEQ_STREAM_NO_KERNELS", raising=False)
    with pytest.raises(SystemExit) as err:
        command.build_extension(ext)
    assert "fairseq_stream._ops_cpu failed (RuntimeError: error: command 'g++' failed" in str(err.value)
    monkeypatch.setenv("FAIRSEQ_STREAM_NO_KERNELS", "1")
    command.build_extension(ext)  # opted out: a note, and the install goes on
    assert "Installing without it (FAIRSEQ_STREAM_NO_KERNELS is set)" in capsys.readouterr().err
    for value, wanted in (("", True), ("0", True), ("no", True), ("1", False), ("yes", False)):
        assert setup_module.kernels_wanted({"FAIRSEQ_STREAM_NO_KERNELS": value}) is wanted


def test_running_without_the_kernels_says_so_once(monkeypatch, caplog):
    from fairseq_stream.ops import loader

    monkeypatch.setattr(loader, "_EXTENSIONS", {})
    monkeypatch.setattr(loader, "_MISSING", {})
    monkeypatch.setitem(sys.modules, "fairseq_stream._ops_cpu", None)  # an import of it raises ImportError
    with caplog.at_level(logging.WARNING, logger=loader.__name__):
        assert loader.compiled_module("cpu") is None and loader.compiled_module("cpu") is None
    messages = [r.getMessage() for r in caplog.records if r.name == loader.__name__]
    assert len(messages) == 1
    assert "compiled CPU kernels (fairseq_stream._ops_cpu)" in messages[0] and "slower torch ops" in messages[0]
    assert "pip install --no-build-isolation -e ." in messages[0]


def test_the_warning_reaches_a_process_without_logging_set_up():
    """The Python API with no logging configured: Python's last-resort handler prints the one line."""
    code = ("import sys; sys.modules['fairseq_stream._ops_cpu'] = None\n"
            "from fairseq_stream.ops.output_layer import compiled_module\n"
            "assert compiled_module('cpu') is None")
    proc = run_tool([sys.executable, "-c", code])
    lines = [line for line in proc.stderr.splitlines() if "fairseq_stream._ops_cpu" in line]
    assert len(lines) == 1 and "--no-build-isolation" in lines[0]
