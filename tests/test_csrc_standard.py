"""The compiled kernels' sources stay C++17: torch 2.13 builds extensions as C++20 here, but a lent GPU
machine's torch 2.11 builds them as C++17, where std::bit_cast broke the whole build (2026-11-27).

A list of the C++20 features most likely to slip in, not a compiler: each source compiles against
torch's headers in 30 s or more, too long to compile twice in CI.
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


def test_kernel_sources_use_no_cxx20_feature():
    found = []
    for path in sorted(p for p in CSRC.rglob("*") if p.suffix in (".cpp", ".h", ".cu", ".cuh")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("//", 1)[0]
            for name, pattern in CXX20.items():
                if re.search(pattern, code):
                    found.append("{}:{}: {}".format(path.relative_to(CSRC), number, name))
    assert found == []
