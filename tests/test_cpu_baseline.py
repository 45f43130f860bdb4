"""A build of the kernels runs on every x86-64 machine of its baseline, not only on the one that built it.

setup.py compiles the generic code for x86-64-v3 (AVX2, FMA) unless
FAIRSEQ_STREAM_MARCH names another target (``native``: this machine); the
AVX-512 kernels are compiled on their own (target attributes) and chosen at
run time. The library records what its generic code assumes
(csrc/cpu/cpu_isa_cpu.cpp), and the plugin refuses, in one log line, a build
this CPU cannot run rather than die with an illegal instruction as it loads.
"""

import importlib.util
import logging
import re
import shutil
import subprocess
import sys
from collections import Counter

import pytest

from conftest import REPO, load_setup
from fairseq_stream import cpu_info
from fairseq_stream.ops import loader
from fairseq_stream.ops import output_layer as ol

# x86-64-v3's extensions as /proc/cpuinfo names them (abm: LZCNT), what a baseline build records.
BASELINE_NEEDS = {"sse4_2", "popcnt", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe"}
# An instruction is AVX-512's if it is EVEX-encoded (first byte 0x62 after segment or address-size prefixes;
# 0x62 is no valid opcode otherwise in 64-bit mode) or works on mask registers (k*, VEX-encoded).
SKIPPED_PREFIXES = {"26", "2e", "36", "3e", "64", "65", "67"}


@pytest.fixture(scope="module")
def setup_module():
    return load_setup()


def built_kernels():
    """The compiled CPU library this process would load, or skip where none is built."""
    spec = importlib.util.find_spec("fairseq_stream._ops_cpu")
    if spec is None or not spec.origin:
        pytest.skip("the CPU kernels are not built (FAIRSEQ_STREAM_NO_KERNELS=1)")
    return spec.origin


def test_the_kernels_compile_for_the_baseline_unless_the_build_names_a_target(setup_module):
    assert setup_module.target_cpu({}, machine="x86_64") == "x86-64-v3"
    assert setup_module.march_flags({}, machine="x86_64") == ["-march=x86-64-v3"]
    assert setup_module.target_cpu({"FAIRSEQ_STREAM_MARCH": " "}, machine="x86_64") == "x86-64-v3"
    assert setup_module.target_cpu({"FAIRSEQ_STREAM_MARCH": " native "}, machine="x86_64") == "native"
    # Elsewhere the compiler's own default, which every machine of the architecture runs.
    assert setup_module.march_flags({}, machine="aarch64") == []
    assert setup_module.march_flags({"FAIRSEQ_STREAM_MARCH": "native"}, machine="aarch64") == ["-march=native"]


def test_the_record_of_what_a_build_needs_is_read_from_the_file(tmp_path):
    library = tmp_path / "lib.so"
    library.write_bytes(b"\x7fELF..." + cpu_info.BUILD_NEEDS_MARKER + b" avx avx2 fma\x00 more data")
    assert cpu_info.build_needs(str(library)) == {"avx", "avx2", "fma"}
    library.write_bytes(b"\x7fELF... an older build, without the record")
    assert cpu_info.build_needs(str(library)) is None
    assert cpu_info.build_needs(str(tmp_path / "absent.so")) is None
    assert cpu_info.missing_extensions({"avx2", "fma", "avx"}, frozenset({"sse4_2", "avx"})) == ["avx2", "fma"]


def test_a_build_for_extensions_this_cpu_lacks_is_refused_in_one_line(monkeypatch, caplog):
    """An AVX-512 build on an AVX2-only CPU (or the baseline on a CPU without AVX2): torch ops, not SIGILL."""
    monkeypatch.setattr(loader, "_EXTENSIONS", {})
    monkeypatch.setattr(loader, "_MISSING", {})
    monkeypatch.setattr(loader, "_library_path", lambda name: "/x/_ops_cpu.so")
    monkeypatch.setattr(cpu_info, "build_needs", lambda path: frozenset({"avx2", "fma", "avx512f", "avx512bw"}))
    monkeypatch.setattr(cpu_info, "_cpuinfo_fields", lambda: ("AVX2 CPU", frozenset({"avx", "avx2", "fma"})))
    with caplog.at_level(logging.WARNING, logger=loader.__name__):
        assert ol.compiled_module("cpu") is None and ol.auto_backend("cpu") == "torch"
    messages = [r.getMessage() for r in caplog.records if r.name == loader.__name__]
    assert len(messages) == 1 and "\n" not in messages[0]
    assert "/x/_ops_cpu.so was built for CPU extensions this CPU (AVX2 CPU) lacks: avx512bw avx512f" in messages[0]
    assert "FAIRSEQ_STREAM_MARCH unset" in messages[0] and "slower torch ops" in messages[0]


def test_a_build_this_cpu_runs_loads():
    origin = built_kernels()
    needs = cpu_info.build_needs(origin)
    assert needs is not None, "the kernels carry no record of their target (csrc/cpu/cpu_isa_cpu.cpp)"
    assert cpu_info.missing_extensions(needs) == []
    assert ol.compiled_module("cpu") is not None


def avx512_instructions(library):
    """Per function (demangled) of ``library``: how many AVX-512 instructions objdump finds in it."""
    listing = subprocess.run(["objdump", "-d", "-C", "--insn-width=15", library], capture_output=True, text=True,
                             check=True).stdout
    found, function = Counter(), None
    for line in listing.splitlines():
        header = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if header:
            function = header.group(1)
            continue
        fields = line.split("\t")
        if len(fields) < 3 or not fields[2].strip():
            continue
        code = [b for b in fields[1].split() if b not in SKIPPED_PREFIXES]
        if (code and code[0] == "62") or fields[2].split()[0].startswith("k"):
            found[function] += 1
    return found


def test_avx512_instructions_lie_only_in_the_avx512_kernels():
    """What makes a baseline build run on an AVX2-only CPU: every AVX-512 instruction is in a kernel chosen at
    run time (its function's name says avx512: skinny_linear_cpu.cpp's avx512::, the int8 and int16 Avx512Vnni
    tiles), none in the generic code, which a native build on an AVX-512 machine fills with them (107 functions
    at 2eeda0a, pybind11's module setup among them: such a build dies as it loads on an AVX2-only CPU)."""
    origin = built_kernels()
    needs = cpu_info.build_needs(origin) or frozenset()
    if "avx512f" in needs:
        pytest.skip("the kernels were built for this machine (FAIRSEQ_STREAM_MARCH=native), not the baseline")
    if shutil.which("objdump") is None:
        pytest.skip("objdump (binutils) is not installed")
    assert needs == BASELINE_NEEDS or sys.platform != "linux" or not needs
    found = avx512_instructions(origin)
    assert [f for f in found if "avx512" not in f.lower()] == []
    # The check sees the kernels' own AVX-512 code (an objdump that printed nothing would pass the line above).
    assert any("avx512::tiles" in f for f in found) and any("Avx512Vnni" in f for f in found)
