#!/usr/bin/env bash
# scripts/gpu_wheels.sh DIR: fetch, on a machine with PyPI, what a lent GPU machine lacks to run
# scripts/gpu_check.sh and scripts/gpu_bench.sh (--wheels DIR). That machine has Python 3.12, a CUDA
# torch, numpy, cython, sacrebleu, sentencepiece, matplotlib, pytest and more (the workplace's list),
# but not fairseq and its configuration packages, nor the WMT'19 stand-in's text tools. It cannot reach
# PyPI, so the files travel with the working tree (docs/GPU.md: carry DIR; about 22 MB).
# Versions are this project's (setup.py); PY_VERSION overrides 3.12.
set -euo pipefail
if [ $# -ne 1 ]; then echo "usage: $0 DIR" >&2; exit 2; fi
dir=$1; py=${PY_VERSION:-3.12}
pip=${PIP:-pip}
mkdir -p "$dir"
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
# Binary wheels for that Python (fairseq-fixed's holds its compiled helpers).
"$pip" download --no-deps --only-binary=:all: --python-version "$py" --implementation cp "${platforms[@]}" \
  -d "$dir" fairseq-fixed==0.12.3.1 bitarray==3.12.3 hydra-core==1.3.2 omegaconf==2.3.0 \
  sacremoses==0.2.0 subword-nmt==0.3.8 mock
# Published as source only: a pure-Python wheel is built here; fastBPE (C++, Cython) is built there
# (gpu_common.install_wheels: pip --no-build-isolation, with that machine's cython and compiler).
"$pip" wheel --no-deps -w "$dir" antlr4-python3-runtime==4.9.3
"$pip" download --no-deps --no-binary=:all: -d "$dir" fastBPE==0.1.0
ls -l "$dir"
