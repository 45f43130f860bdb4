#!/usr/bin/env bash
# Compile every CUDA source of the extension (fairseq_stream/ops/csrc/cuda) to object files
# with a real nvcc, on a machine without a GPU, with the flags torch's CUDAExtension +
# BuildExtension give them in a real build (taken from torch.utils.cpp_extension itself).
#
#   bash scripts/check_cuda_compile.sh [OUT_DIR]      # default OUT_DIR: build/cuda-compile-check
#
# The toolchain comes from PyPI, pinned, into .cuda-toolchain/ (git-ignored; not the venv;
# FAIRSEQ_STREAM_CUDA_TOOLCHAIN moves it); an install whose pins match is reused. The CUDA 12
# wheels (nvidia-cuda-nvcc-cu12 12.x) hold ptxas and libnvvm but no nvcc driver, cudafe++ or
# cicc, so they cannot compile a .cu: the toolchain is CUDA 13.0's, whose wheels hold the whole
# compiler (nvidia-cuda-nvcc: nvcc, cudafe++, ptxas, fatbinary; nvidia-nvvm: cicc;
# nvidia-cuda-crt: the crt headers), plus the runtime headers and CCCL.
#
# Each .cu compiles once per architecture (CUDA_ARCHS, default "8.0 9.0": sm_80 and sm_90);
# each .cpp (the ATen binding) once with the C++ compiler; then every fairseq_stream:: symbol
# the binding needs must be defined by the .cu objects. One line per source and arch; the
# command lines go to OUT_DIR/commands.txt. About 50 s on one core (the binding, which
# includes torch/python.h for pybind11, takes most of it). Exit 0: all compiled; 1: a compile error
# (the compiler's message is printed); 77: the toolchain could not be installed (no PyPI):
# tests/test_cuda_compile.py skips on that.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

OUT=${1:-build/cuda-compile-check}
VENV=${FAIRSEQ_STREAM_VENV:-.venv}
PY=${PYTHON:-$VENV/bin/python}
TOOLCHAIN=${FAIRSEQ_STREAM_CUDA_TOOLCHAIN:-.cuda-toolchain}
ARCHS=${CUDA_ARCHS:-"8.0 9.0"}
SRC_DIR=fairseq_stream/ops/csrc/cuda
PINS=(
  nvidia-cuda-nvcc==13.0.88
  nvidia-nvvm==13.0.88
  nvidia-cuda-crt==13.0.88
  nvidia-cuda-runtime==13.0.96
  nvidia-cuda-cccl==13.0.85
)

[ -x "$PY" ] || PY=python3
mkdir -p "$OUT" || exit 1
OUT=$(cd "$OUT" && pwd)
mkdir -p "$TOOLCHAIN" || exit 1
TOOLCHAIN=$(cd "$TOOLCHAIN" && pwd)
CUDA_HOME_DIR=$TOOLCHAIN/nvidia/cu13
NVCC=$CUDA_HOME_DIR/bin/nvcc

# --- the toolchain: pip install only when the pinned set is not there yet.
STAMP=$TOOLCHAIN/.pins
WANT="${PINS[*]}"
if [ ! -x "$NVCC" ] || [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  echo "installing the CUDA toolchain into $TOOLCHAIN: $WANT"
  rm -rf "$TOOLCHAIN/nvidia" "$STAMP" "$TOOLCHAIN"/nvidia_*.dist-info
  if ! "$PY" -m pip install --quiet --no-deps --disable-pip-version-check --timeout 30 --retries 2 --target "$TOOLCHAIN" "${PINS[@]}" \
      >"$OUT/pip.log" 2>&1; then
    grep -v "is ignored: it is neither a file nor a directory" "$OUT/pip.log" | tail -n 15
    echo "SKIP: could not install the CUDA toolchain from PyPI (pip's output above, all of it in $OUT/pip.log)"
    exit 77
  fi
  echo "$WANT" >"$STAMP"
fi
[ -x "$NVCC" ] || { echo "FAIL: no nvcc at $NVCC after the install"; exit 1; }
echo "nvcc: $("$NVCC" --version | grep -o 'release [0-9.]*, V[0-9.]*')"

# --- the flags, from torch.utils.cpp_extension (as BuildExtension composes them for
# CUDAExtension("fairseq_stream._ops_cuda", ...) in setup.py). Lines: NAME<TAB>shell-quoted args.
FLAGS=$("$PY" - "$CUDA_HOME_DIR" "$ARCHS" <<'EOF'
import os, shlex, sys, sysconfig
cuda_home, archs = sys.argv[1], sys.argv[2].split()
from torch.utils import cpp_extension as ce
from setuptools._distutils.ccompiler import new_compiler
from setuptools._distutils.sysconfig import customize_compiler

ce.CUDA_HOME = cuda_home  # a CPU torch leaves it None; CUDAExtension's include_paths("cuda") reads it
cc = new_compiler(); customize_compiler(cc)
defines = ["-DTORCH_API_INCLUDE_EXTENSION_H", "-DTORCH_EXTENSION_NAME=_ops_cuda"]  # BuildExtension's
includes = ["-I" + p for p in ce.include_paths("cuda") + [sysconfig.get_paths()["include"]]]
if sys.prefix != sys.base_prefix:  # distutils' build_ext adds the venv's include too
    includes.append("-I" + os.path.join(sys.prefix, "include"))
# .cpp: distutils' compiler_so flags + include dirs + extra args + -std=c++20 (ninja: $CXX or c++).
cxx = os.environ.get("CXX", "c++")
print("CXX\t" + shlex.join([cxx] + cc.compiler_so[1:] + includes + defines + ["-std=c++20"]))
# .cu: include dirs + COMMON_NVCC_FLAGS + -fPIC + extra args + -gencode (from TORCH_CUDA_ARCH_LIST) + -std=c++20.
nvcc = includes + ce.COMMON_NVCC_FLAGS + ["--compiler-options", "-fPIC"] + defines
if os.environ.get("CC"):
    nvcc += ["-ccbin", os.environ["CC"]]
print("NVCC\t" + shlex.join(nvcc + ["-std=c++20"]))
for arch in archs:
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch
    print("ARCH\t" + arch.replace(".", "") + "\t" + shlex.join(ce._get_cuda_arch_flags([])))
EOF
) || { echo "FAIL: could not read the build flags from torch.utils.cpp_extension"; exit 1; }
CXX_CMD=$(printf '%s\n' "$FLAGS" | awk -F'\t' '$1=="CXX"{print $2}')
NVCC_FLAGS=$(printf '%s\n' "$FLAGS" | awk -F'\t' '$1=="NVCC"{print $2}')

# A CPU torch lacks the one header its CUDA build generates (c10/cuda/impl/cuda_cmake_macros.h,
# from torch's cuda_cmake_macros.h.in): write it as that build does, versions from this nvcc.
SHIM=$OUT/include-shim
mkdir -p "$SHIM/c10/cuda/impl"
read -r MAJ MIN PATCH < <("$NVCC" --version | sed -n 's/.*V\([0-9]*\)\.\([0-9]*\)\.\([0-9]*\).*/\1 \2 \3/p')
cat >"$SHIM/c10/cuda/impl/cuda_cmake_macros.h" <<EOF
#pragma once
// Written by scripts/check_cuda_compile.sh as torch's CUDA build generates it.
#define C10_CUDA_BUILD_SHARED_LIBS
#define TORCH_CUDA_VERSION_MAJOR $MAJ
#define TORCH_CUDA_VERSION_MINOR $MIN
#define TORCH_CUDA_VERSION_PATCH $PATCH
#define TORCH_CUDA_VERSION_BUILD 0
EOF

# nvcc finds cicc, ptxas and its headers through its nvcc.profile; the host compiler is the
# system's (gcc/g++ on PATH, or $CC as in torch's build).
export PATH="$CUDA_HOME_DIR/bin:$PATH"
failed=0
run() {  # label, object, command...
  local label=$1 obj=$2; shift 2
  local t0=$SECONDS
  { printf '%q ' "$@"; echo; } >>"$OUT/commands.txt"
  if "$@" </dev/null >"$obj.log" 2>&1; then
    echo "ok    $label ($((SECONDS - t0)) s)"
  else
    echo "FAIL  $label ($((SECONDS - t0)) s):"
    cat "$obj.log"
    failed=1
  fi
}

shopt -s nullglob
CU=("$SRC_DIR"/*.cu)
CPP=("$SRC_DIR"/*.cpp)
[ ${#CU[@]} -gt 0 ] || { echo "FAIL: no .cu under $SRC_DIR"; exit 1; }
rm -f "$OUT"/*.o "$OUT"/*.o.log "$OUT/commands.txt"
for src in "${CU[@]}"; do
  name=$(basename "$src" .cu)
  while IFS=$'\t' read -r tag sm gencode; do
    [ "$tag" = ARCH ] || continue
    obj=$OUT/$name.sm_$sm.o
    # shellcheck disable=SC2086  # the flag lists are shell-quoted by Python's shlex
    eval "set -- $NVCC_FLAGS $gencode"
    run "$src sm_$sm (nvcc)" "$obj" "$NVCC" -I"$SHIM" -c "$ROOT/$src" -o "$obj" "$@"
  done <<<"$FLAGS"
done
cpp_objects=()
for src in "${CPP[@]}"; do
  obj=$OUT/$(basename "$src" .cpp).o
  eval "set -- $CXX_CMD"
  run "$src host ($1)" "$obj" "$@" -I"$SHIM" -c "$ROOT/$src" -o "$obj"
  [ -f "$obj" ] && cpp_objects+=("$obj")
done
# Header/definition agreement, short of linking (no libtorch_cuda here): every
# fairseq_stream:: function the bindings call is defined, with the same signature, by the .cu
# sources' objects of each arch together. A template's name is printed after its return type.
if [ $failed -eq 0 ] && command -v nm >/dev/null; then
  needed=$(nm -C "${cpp_objects[@]}" | sed -n 's/^ *U \(.*fairseq_stream::.*\)$/\1/p' | sort -u)
  for arch in $ARCHS; do
    sm=${arch/./}
    arch_objects=("$OUT"/*.sm_"$sm".o)
    missing=$(comm -23 <(printf '%s\n' "$needed") \
      <(nm -C "${arch_objects[@]}" | sed -n 's/^[0-9a-f]* [TW] \(.*fairseq_stream::.*\)$/\1/p' | sort -u))
    if [ -n "$missing" ]; then
      echo "FAIL  the sm_$sm objects do not define what the bindings call:"
      echo "$missing"
      failed=1
    else
      echo "ok    symbols: the bindings' $(printf '%s\n' "$needed" | grep -c .) fairseq_stream:: calls are defined in the sm_$sm objects"
    fi
  done
fi

if [ $failed -ne 0 ]; then
  echo "CUDA compile check FAILED (objects and logs in $OUT)"
  exit 1
fi
echo "CUDA compile check passed: ${#CU[@]} .cu x archs [$ARCHS] and ${#CPP[@]} .cpp compiled into $OUT (torch $("$PY" -c 'import torch; print(torch.__version__)'))"
