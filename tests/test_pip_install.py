"""The README's install commands work with the pip and setuptools a user may have.

`pip install --no-build-isolation -e .` must build the kernels in the
environment that has torch. Without pyproject.toml, pip 23.2.1 (the pip of
Python 3.11's venv) with the wheel package installed ran `setup.py develop`,
which setuptools 80 and newer turns into `pip install -e . --use-pep517`
without --no-build-isolation: the kernels' build ran where torch is not
importable, and the install stopped.

Each case installs a copy of the project into a throwaway venv with those
versions, in seconds: `--no-deps`, and a stand-in for torch (STUB_TORCH) whose
extension build writes an empty file where the kernels would go, so no
compiler runs and no torch is downloaded. The stand-in lies in the venv's
site-packages, which pip's build isolation hides, so the empty file appears
only where the build ran in the venv, as the real kernels need. pip and
setuptools come from PyPI (or pip's cache); without them the test skips.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

# (pip, setuptools) pairs: Python 3.11's venv's pip with setuptools 80 (the failure above), and the
# versions scripts/setup_env.sh installs today (the newest, as in this venv). Each with wheel installed.
OLD_PIP = ("pip==23.2.1", "setuptools==80.9.0")

# The stand-in for torch: what setup.py uses of it (torch.version.cuda, cpp_extension's CppExtension,
# BuildExtension, CUDA_HOME). Its build_ext writes an empty file as the extension.
STUB_TORCH = {
    "torch/__init__.py": "class version:\n    cuda = None\n",
    "torch/utils/__init__.py": "",
    "torch/utils/cpp_extension.py": (
        "import os\n"
        "from setuptools import Extension\n"
        "from setuptools.command.build_ext import build_ext\n"
        "CUDA_HOME = None\n\n"
        "def CppExtension(name, sources, **kwargs):\n"
        "    return Extension(name, sources, language='c++', **kwargs)\n\n"
        "class BuildExtension(build_ext):\n"
        "    def build_extension(self, ext):\n"
        "        path = self.get_ext_fullpath(ext.name)\n"
        "        os.makedirs(os.path.dirname(path), exist_ok=True)\n"
        "        open(path, 'wb').close()\n"
    ),
}


def run(argv, cwd=None, env=None):
    """A command with this process's environment less PYTHONPATH (which would shadow the venv's install)."""
    full = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    full.update(env or {})
    return subprocess.run([str(a) for a in argv], cwd=cwd, env=full, capture_output=True, text=True)


def installed_version(name):
    from importlib.metadata import version

    return "{}=={}".format(name, version(name))


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """A throwaway venv with the stand-in torch and wheel; ``versions(pip, setuptools)`` installs those."""
    root = tmp_path_factory.mktemp("pip-install") / "venv"
    made = run([sys.executable, "-m", "venv", root])
    assert made.returncode == 0, made.stderr
    python = root / "bin" / "python"
    purelib = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    for name, text in STUB_TORCH.items():
        path = Path(purelib) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    def versions(*requirements):
        proc = run([python, "-m", "pip", "install", "-q", "wheel"] + list(requirements))
        if proc.returncode != 0:
            pytest.skip("cannot install {} (no PyPI and not in pip's cache): {}".format(
                " ".join(requirements), proc.stderr.strip().splitlines()[-1:]))
        return python

    return versions


def project_copy(parent):
    """What `pip install .` reads of the project, copied (the install writes build files into it)."""
    dest = parent / "fairseq-stream"
    shutil.copytree(REPO / "fairseq_stream", dest / "fairseq_stream",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    for name in ("setup.py", "pyproject.toml", "README.md"):
        if (REPO / name).exists():
            shutil.copy(REPO / name, dest / name)
    return dest


def install(python, project, *args, env=None):
    proc = run([python, "-m", "pip", "install", "--no-deps", "--no-build-isolation"] + list(args), cwd=project,
               env=env)
    assert proc.returncode == 0, "pip install {} failed:\n{}\n{}".format(" ".join(args), proc.stdout[-2000:],
                                                                        proc.stderr[-4000:])
    return proc


def origin(python, module):
    """Where ``python`` finds ``module``, without importing it (the package would import torch)."""
    code = "import importlib.util as u; print(u.find_spec({!r}).origin)".format(module)
    return Path(run([python, "-c", code], cwd="/").stdout.strip())


def kernel_files(tree):
    return sorted(p.name for p in (tree / "fairseq_stream").glob("_ops_cpu*"))


@pytest.mark.parametrize("pip_versions", [OLD_PIP, "this venv's"])
def test_the_editable_install_builds_the_kernels_in_the_venv_and_maps_to_the_source(venv, tmp_path, pip_versions):
    if pip_versions == "this venv's":
        pip_versions = (installed_version("pip"), installed_version("setuptools"))
    python = venv(*pip_versions)
    project = project_copy(tmp_path)
    install(python, project, "-e", ".[test]")  # as scripts/setup_env.sh runs it
    assert kernel_files(project) and kernel_files(project)[0].endswith(".so")
    assert origin(python, "fairseq_stream") == project / "fairseq_stream" / "__init__.py"


def test_no_kernels_and_the_plain_install_with_pip_23(venv, tmp_path):
    python = venv(*OLD_PIP)
    project = project_copy(tmp_path)
    install(python, project, "-e", ".", env={"FAIRSEQ_STREAM_NO_KERNELS": "1"})
    assert kernel_files(project) == []
    assert origin(python, "fairseq_stream") == project / "fairseq_stream" / "__init__.py"
    install(python, project, ".")  # the README's "or without -e": a wheel, installed into the venv
    installed = origin(python, "fairseq_stream").parent
    assert installed != project / "fairseq_stream" and "site-packages" in installed.parts
    assert [p.name for p in installed.glob("_ops_cpu*.so")] and (installed / "presets" / "README.md").exists()
