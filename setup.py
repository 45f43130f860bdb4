"""Install fairseq-stream: ``pip install --no-build-isolation -e .`` after torch.

The compiled output-layer kernels are optional. The CPU extension is built
whenever its sources are present; the CUDA extension only where the installed
torch has CUDA. A failed or skipped build leaves a working install that falls
back to torch ops (``fairseq_stream.ops`` says which backend it uses).
"""

import glob
import os

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


def _sources(pattern):
    return sorted(glob.glob(os.path.join(CSRC, pattern)))


def optional_extensions():
    """The extensions this machine can build, and the build_ext command for them."""
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:  # torch must be installed first (no build isolation)
        return [], {}

    extensions = []
    cpu_sources = _sources("cpu/*.cpp")
    if cpu_sources:
        extensions.append(
            cpp_extension.CppExtension(
                "fairseq_stream._ops_cpu",
                cpu_sources,
                # -fno-trapping-math: lets loops with selects vectorize (rnn_step_cpu.cpp); no result changes.
                extra_compile_args=["-O3", "-march=native", "-fopenmp", "-fno-trapping-math"],
                extra_link_args=["-fopenmp"],
            )
        )
    cuda_sources = _sources("cuda/*.cu") + _sources("cuda/*.cpp")
    if cuda_sources and torch.version.cuda and cpp_extension.CUDA_HOME:
        extensions.append(
            cpp_extension.CUDAExtension("fairseq_stream._ops_cuda", cuda_sources)
        )
    if not extensions:
        return [], {}

    class OptionalBuildExt(cpp_extension.BuildExtension):
        """Build each extension if possible; a failure only costs the fast path."""

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as e:  # noqa: BLE001 - any compiler failure is optional
                print("fairseq-stream: skipping optional extension {}: {}".format(ext.name, e))

    return extensions, {"build_ext": OptionalBuildExt}


ext_modules, cmdclass = optional_extensions()

setup(
    name="fairseq-stream",
    version="0.1.0",
    description="Faster decoding for fairseq translation models (fairseq plugin)",
    long_description=open(os.path.join(HERE, "README.md")).read()
    if os.path.exists(os.path.join(HERE, "README.md"))
    else "",
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
