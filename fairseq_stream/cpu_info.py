"""What CPU this is: its model name and the widest SIMD level it runs, for cost caches and benchmark records.

Speed measured on one CPU says little about another: the skinny product
(:mod:`fairseq_stream.ops.product`) has AVX-512 and AVX2 tiles, the int16
kernels pick AVX-512 VNNI or AVX2 (:func:`fairseq_stream.ops.int16_linear.kernels`),
and Jacobi's window calls pay on an AVX-512 Xeon but not on an AVX2-only EPYC.
So anything timed is recorded, and cached, with :func:`cpu_model` and
:func:`simd_level`.
"""

import os
import platform
from functools import lru_cache
from typing import FrozenSet, Iterable, List, Optional

# Widest first: the first whose flags are all present is the CPU's level.
SIMD_LEVELS = (("avx512_vnni", ("avx512f", "avx512_vnni")), ("avx512f", ("avx512f",)), ("avx2", ("avx2", "fma")))
# ATen's ATEN_CPU_CAPABILITY values that lower its dispatch, as levels here: the compiled kernels follow
# ATen's cap (csrc/cpu/cpu_isa_cpu.h), so timings taken under it are those of the capped level.
CAPS = {"default": "portable", "avx2": "avx2"}
# What the compiled kernels carry in their data (csrc/cpu/cpu_isa_cpu.cpp): this, then the extensions their
# generic code was compiled to assume, space-separated, as /proc/cpuinfo names them.
BUILD_NEEDS_MARKER = b"fairseq-stream-build-needs:"


@lru_cache(maxsize=1)
def _cpuinfo():
    """(model name, flags, vendor id) from /proc/cpuinfo's first processor; None for each it does not give."""
    name, flags, vendor = None, None, None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and name is None:
                    name = value.strip()
                elif key == "flags" and flags is None:
                    flags = frozenset(value.split())
                elif key == "vendor_id" and vendor is None:
                    vendor = value.strip()
                if name is not None and flags is not None and vendor is not None:
                    break
    except OSError:
        pass
    return name, flags, vendor


def _cpuinfo_fields():
    """(model name, flags) from /proc/cpuinfo's first processor; (None, None) where there is none."""
    name, flags, _ = _cpuinfo()
    return name, flags


def cpu_vendor() -> str:
    """The CPU's maker as /proc/cpuinfo names it ("GenuineIntel", "AuthenticAMD"), or "" where it does not say.

    MKL runs its own tuned code on Intel's CPUs only (on others its generic code), which is why
    the float32 product may take oneDNN's GEMM elsewhere (:mod:`fairseq_stream.ops.product`).
    """
    return _cpuinfo()[2] or ""


def cpu_model() -> str:
    """The CPU's model name ("AMD EPYC", "Intel(R) Xeon(R) ..."), or the platform's guess."""
    name, _ = _cpuinfo_fields()
    return name or platform.processor() or "unknown CPU"


def level_from_flags(flags: FrozenSet[str]) -> str:
    """The widest of "avx512_vnni", "avx512f", "avx2" all of whose flags are in ``flags``, else "portable"."""
    for level, needed in SIMD_LEVELS:
        if all(f in flags for f in needed):
            return level
    return "portable"


def capped(level: str, environ=os.environ) -> str:
    """``level``, or the narrower one ``ATEN_CPU_CAPABILITY`` caps torch's and our kernels to."""
    cap = CAPS.get(environ.get("ATEN_CPU_CAPABILITY", "").strip().lower())
    order = [name for name, _ in SIMD_LEVELS] + ["portable"]
    return cap if cap is not None and order.index(cap) > order.index(level) else level


@lru_cache(maxsize=1)
def simd_level() -> str:
    """The widest SIMD level the kernels use here: "avx512_vnni", "avx512f", "avx2" or "portable".

    From /proc/cpuinfo's flags, capped as ``ATEN_CPU_CAPABILITY`` caps
    torch's dispatch and ours; elsewhere from what torch dispatches to
    (which does not tell VNNI apart).
    """
    _, flags = _cpuinfo_fields()
    if flags is not None:
        return capped(level_from_flags(flags))
    try:
        import torch

        capability = torch.backends.cpu.get_cpu_capability()
    except (ImportError, AttributeError):
        return "portable"
    return {"AVX512": "avx512f", "AVX2": "avx2"}.get(capability, "portable")


def describe() -> str:
    """``model (level)``, e.g. "AMD EPYC (avx2)": the CPU as logs and benchmark records name it."""
    return "{} ({})".format(cpu_model(), simd_level())


def build_needs(path: str) -> Optional[FrozenSet[str]]:
    """The CPU extensions the compiled library at ``path`` assumes throughout, or None where it records none.

    Read from the file, not by loading it: a library built for extensions the
    CPU lacks dies with an illegal instruction as it loads.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    start = data.find(BUILD_NEEDS_MARKER)
    if start < 0:  # built before the record, or not by setup.py
        return None
    end = data.find(b"\0", start)
    return frozenset(data[start + len(BUILD_NEEDS_MARKER):end].decode("ascii", "replace").split())


def missing_extensions(needs: Iterable[str], flags: Optional[FrozenSet[str]] = None) -> List[str]:
    """Those of ``needs`` that this CPU (or ``flags``) lacks, sorted; none where /proc/cpuinfo cannot tell."""
    if flags is None:
        _, flags = _cpuinfo_fields()
    if flags is None:
        return []
    return sorted(set(needs) - flags)
