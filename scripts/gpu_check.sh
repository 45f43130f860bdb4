#!/usr/bin/env bash
# scripts/gpu_check.sh OUTDIR [options]: benchmarks/gpu_check.py with the right interpreter.
# $PYTHON if set, else this checkout's .venv, else python3 (a lent GPU machine's, which holds a CUDA
# torch). --help lists the options; docs/GPU.md says how to run it on a GPU and what it writes.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-}
if [ -z "$py" ]; then
  if [ -x "$repo/.venv/bin/python" ]; then py=$repo/.venv/bin/python; else py=$(command -v python3); fi
fi
exec "$py" "$repo/benchmarks/gpu_check.py" --python "$py" "$@"
