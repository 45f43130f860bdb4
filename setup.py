"""Install fairseq-stream: ``pip install --no-build-isolation -e .`` after torch.

    pip install torch==2.13.0 numpy==2.4.6 cython ninja   # ninja: the kernels compile on every core
    pip install --no-build-isolation -e .          # or without -e

The compiled kernels (fairseq_stream._ops_cpu, and _ops_cuda where the
installed torch has CUDA and a CUDA toolkit is found) are what make the
searches fast. They compile against the installed torch, hence no build
isolation. A CPU kernel that cannot be built (torch not importable here, no
C++ compiler, a compile error) stops the install with the reason: pip shows a
successful build's output only with -v, so a warning would go unseen and the
install would silently run every fast path on torch ops.
FAIRSEQ_STREAM_NO_KERNELS=1 installs without the kernels on purpose (the
plugin then logs at run time what runs slower). The CUDA kernel is skipped,
with a note, where torch has CUDA but no CUDA toolkit is found.

The kernels' generic code compiles for a baseline every x86-64 machine of the
last decade runs (x86-64-v3: AVX2, FMA), so a build moves to other machines;
the AVX-512 kernels are compiled on their own and chosen at run time.
FAIRSEQ_STREAM_MARCH=native builds for this machine only (target_cpu).
"""

import glob
import os
import platform
import sys

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join("fairseq_stream", "ops", "csrc")

REQUIREMENTS = [
    "torch==2.13.0",
    "fairseq-fixed==0.12.3.1",
    "numpy==2.4.6",
    "sacrebleu==2.6.0",
    "sentencepiece==0.2.3",
    "tqdm==4.70.1",
    "matplotlib==3.11.2",
    # The newstest tools: fairseq's --tokenizer moses and --bpe fastbpe (the WMT'19 models'),
    # and subword-nmt to learn fastBPE-format codes for the WMT'19 stand-in. fastBPE builds
    # from source with Cython, hence after torch/numpy/cython and without build isolation.
    "sacremoses==0.2.0",
    "fastBPE==0.1.0",
    "subword-nmt==0.3.8",
]


NO_KERNELS_VARIABLE = "FAIRSEQ_STREAM_NO_KERNELS"
HOW_TO_BUILD = (
    "Install torch first and build without isolation, so that the kernels compile against it: "
    "pip install torch==2.13.0 numpy==2.4.6 cython && pip install --no-build-isolation -e . "
    "(a C++ compiler is needed). To install without the kernels anyway (every fast path then runs on "
    "slower torch ops), set {}=1.".format(NO_KERNELS_VARIABLE))


def _sources(pattern):
    return sorted(glob.glob(os.path.join(CSRC, pattern)))


def kernels_wanted(environ=os.environ):
    """False where the user asked for an install without the compiled kernels."""
    return environ.get(NO_KERNELS_VARIABLE, "").strip().lower() in ("", "0", "false", "no")


# The generic code's target on x86-64 where FAIRSEQ_STREAM_MARCH names none: AVX2, FMA, BMI2, F16C, MOVBE (Intel
# Core and Xeon since Haswell, 2013, AMD since Excavator, 2015). Not x86-64-v2 (SSE4.2): it would
# compile the vectorized loops at half width and without FMA on every machine, for the few
# AVX-less CPUs still running (Atom-class); such a CPU gets a one-line refusal and torch ops
# (fairseq_stream/ops/output_layer.py) rather than an illegal instruction.
BASELINE_MARCH = "x86-64-v3"


def target_cpu(environ=os.environ, machine=None):
    """The ``-march`` the kernels are compiled for ("" for the compiler's default).

    ``FAIRSEQ_STREAM_MARCH`` where set (``native``: this machine's every
    extension, e.g. AVX-512 on a Xeon, for a build that stays here); else the
    baseline: x86-64-v3 on x86-64, the compiler's default elsewhere. A
    baseline build runs on every machine of its architecture (a cluster's
    shared virtual environment, a wheel); the kernels that need more (the
    AVX-512 and VNNI tiles) are compiled for it on their own, with target
    attributes, and chosen at run time from what the CPU reports.
    """
    given = environ.get("FAIRSEQ_STREAM_MARCH", "").strip()
    if given:
        return given
    machine = (machine if machine is not None else platform.machine()).lower()
    return BASELINE_MARCH if machine in ("x86_64", "amd64") else ""


def march_flags(environ=os.environ, machine=None):
    """The compiler flags for :func:`target_cpu`: ``["-march=..."]``, or none for the compiler's default."""
    march = target_cpu(environ, machine)
    return ["-march=" + march] if march else []


SANITIZE_VARIABLE = "FAIRSEQ_STREAM_SANITIZE"
SANITIZERS = "-fsanitize=address,undefined,float-cast-overflow"


def sanitizer_flags(environ=os.environ):
    """(compile, link) flags for the kernels: AddressSanitizer and UBSan where ``FAIRSEQ_STREAM_SANITIZE=1``.

    For scripts/sanitize_kernels.sh, which builds apart and runs the kernel tests under them. UBSan does not
    check a float converted to an out-of-range integer (a NaN to int32) unless float-cast-overflow is named;
    -fno-sanitize-recover makes any finding stop the process, so that the test that hit it fails; -g1 gives
    the reports line numbers (the build's -g0 leaves none).
    """
    if environ.get(SANITIZE_VARIABLE, "").strip().lower() in ("", "0", "false", "no"):
        return [], []
    return [SANITIZERS, "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g1"], [SANITIZERS]


def kernel_problem(what, environ=os.environ):
    """A kernel cannot be built: stop the install, or only warn where the user opted out."""
    message = "fairseq-stream: {}.".format(what)
    if kernels_wanted(environ):
        raise SystemExit("\n{}\n{}\n".format(message, HOW_TO_BUILD))
    print("{} Installing without it ({} is set): the plugin runs on torch ops, slower.".format(
        message, NO_KERNELS_VARIABLE), file=sys.stderr)


def optional_extensions():
    """The extensions this machine can build, and the build_ext command for them."""
    if not kernels_wanted():
        print("fairseq-stream: {} is set: installing without the compiled kernels".format(NO_KERNELS_VARIABLE),
              file=sys.stderr)
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as e:  # torch must be installed first and visible (no build isolation)
        kernel_problem("cannot build the compiled kernels: torch is not importable by this build ({}: {}): "
                       "it is not installed yet, or pip's build isolation (an install without "
                       "--no-build-isolation) hides it".format(type(e).__name__, e))
        return [], {}

    extensions = []
    cpu_sources = _sources("cpu/*.cpp")
    if cpu_sources:
        sanitize_compile, sanitize_link = sanitizer_flags()
        extensions.append(
            cpp_extension.CppExtension(
                "fairseq_stream._ops_cpu",
                cpu_sources,
                # -fno-trapping-math: lets loops with selects vectorize (rnn_step_cpu.cpp); no result changes.
                # -g0 overrides the -g of Python's CFLAGS: debug info for torch's headers was a quarter of each
                # file's compile time (66 s -> 51 s for int16_linear_cpu.cpp on the AVX2 EPYC).
                extra_compile_args=["-O3", "-g0"] + march_flags() + ["-fopenmp", "-fno-trapping-math"]
                + sanitize_compile,
                extra_link_args=["-fopenmp"] + sanitize_link,
            )
        )
    else:
        kernel_problem("no CPU kernel sources under {}".format(CSRC))
    cuda_sources = _sources("cuda/*.cu") + _sources("cuda/*.cpp")
    if cuda_sources and torch.version.cuda and cpp_extension.CUDA_HOME:
        extensions.append(
            cpp_extension.CUDAExtension("fairseq_stream._ops_cuda", cuda_sources)
        )
    elif cuda_sources and torch.version.cuda:
        print("fairseq-stream: skipping the CUDA kernel: torch has CUDA {} but no CUDA toolkit was found "
              "(set CUDA_HOME to build it)".format(torch.version.cuda), file=sys.stderr)
    if not extensions:
        return [], {}
    return extensions, {"build_ext": kernel_build_command(cpp_extension.BuildExtension)}


def kernel_build_command(base):
    """torch's BuildExtension, with a failed kernel reported as what it costs and how to get it."""

    class KernelBuildExt(base):
        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as e:  # noqa: BLE001 - the compiler's or ninja's failure, whatever its type
                last = (str(e).strip().splitlines() or [""])[-1]
                kernel_problem("building the compiled kernel {} failed ({}: {}); the compiler's output is "
                               "above".format(ext.name, type(e).__name__, last))

    return KernelBuildExt


def main():
    ext_modules, cmdclass = optional_extensions()
    setup(**arguments(ext_modules, cmdclass))


def arguments(ext_modules, cmdclass):
    """setup()'s keyword arguments."""
    readme = os.path.join(HERE, "README.md")
    return dict(
        name="fairseq-stream",
        version="0.1.0",
        description="Faster decoding for fairseq translation models (fairseq plugin)",
        long_description=open(readme).read() if os.path.exists(readme) else "",
        long_description_content_type="text/markdown",
        python_requires=">=3.10",
        packages=find_packages(include=["fairseq_stream", "fairseq_stream.*"]),
        # The --preset files ship with the plugin, so a non-editable install finds them too.
        package_data={"fairseq_stream.presets": ["*.args", "README.md"]},
        install_requires=REQUIREMENTS,
        extras_require={"test": ["pytest==9.2.0", "pytest-xdist==3.8.0"], "bench": ["ctranslate2==4.8.5"]},
        ext_modules=ext_modules,
        cmdclass=cmdclass,
        entry_points={
            "console_scripts": [
                "fairseq-stream-generate = fairseq_stream.cli:generate",
                "fairseq-stream-interactive = fairseq_stream.cli:interactive",
                "fairseq-stream-user-dir = fairseq_stream.cli:print_plugin_dir",
                "fairseq-stream-bulk = fairseq_stream.bulk:main",
            ]
        },
    )


# pip's setuptools backend and ``python setup.py`` run this file as __main__; tests import it.
if __name__ == "__main__":
    main()
