"""The compiled kernels' sources stay C++17: torch 2.13 builds extensions as C++20 here, but a lent GPU
machine's torch 2.11 builds them as C++17, where std::bit_cast broke the whole build (2026-11-27).

A list of the C++20 features most likely to slip in, not a compiler: the sources compile against
torch's headers in about 3 minutes of CPU, too long to compile twice in CI.

And the sources include only the torch headers they need (below).
"""

import re
from pathlib import Path

CSRC = Path(__file__).resolve().parents[1] / "fairseq_stream" / "ops" / "csrc"
CXX20 = {
    "std::bit_cast": r"\bstd::bit_cast\b",
    "#include <bit>, <span>, <ranges>, <concepts>, <numbers>, <format>":
        r"#include\s*<(bit|span|ranges|concepts|numbers|format|compare|source_location)>",
    "consteval / constinit / co_await / co_return / requires": r"\b(consteval|constinit|co_await|co_return|requires)\b",
    "the three-way comparison <=>": r"<=>",
    "designated initializers { .name = ... }": r"[{,]\s*\.[A-Za-z_]\w*\s*=",
    "std::span, std::ranges, std::format": r"\bstd::(span|ranges|format)\b",
}


def source_lines():
    """(path relative to csrc, line number, the line's code without its // comment) of every kernel source."""
    for path in sorted(p for p in CSRC.rglob("*") if p.suffix in (".cpp", ".h", ".cu", ".cuh")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            yield path.relative_to(CSRC).as_posix(), number, line.split("//", 1)[0]


def test_kernel_sources_use_no_cxx20_feature():
    found = []
    for rel, number, code in source_lines():
        for name, pattern in CXX20.items():
            if re.search(pattern, code):
                found.append("{}:{}: {}".format(rel, number, name))
    assert found == []


# The umbrella headers: torch's whole C++ API (autograd, nn, optim, data), or every ATen op (<ATen/ATen.h>,
# 19 s a source against 4 for <ATen/core/Tensor.h>, measured beside a running test suite).
WHOLE_TORCH = r"#include\s*<(torch/(extension|all|torch)|ATen/ATen)\.h>"
# Only the Python bindings need torch's pybind11 type casters (<torch/python.h>).
BINDINGS = {"cpu/bindings_cpu.cpp", "output_layer_binding.h", "cuda/output_layer_cuda_binding.cpp"}


def test_sources_include_aten_not_the_whole_torch_api():
    """<torch/extension.h> in every source made the kernels' build 5.7 minutes on 2 cores, 1.7 with ATen's headers.

    Each file took 50-75 s to compile, most of it torch's C++ API and pybind11, which no kernel uses (Zen 4
    EPYC, 2026-12-03): the kernels include <ATen/core/Tensor.h> and the <ATen/ops/NAME.h> of each op they
    call; the bindings <torch/python.h>.
    """
    found = ["{}:{}: {}".format(rel, number, code.strip()) for rel, number, code in source_lines()
             if re.search(WHOLE_TORCH, code) or (rel not in BINDINGS and re.search(r"#include\s*<torch/", code))]
    assert found == []
