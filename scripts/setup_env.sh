#!/usr/bin/env bash
# Create the project's virtual environment (.venv, or $FAIRSEQ_STREAM_VENV) with
# torch, fairseq-fixed and fairseq-stream installed. Idempotent: a stamp holding
# the hash of setup.py skips the work when nothing changed.
#
# pip's and setuptools' output (including setuptools' "Editable installation"
# warning) goes to $VENV/setup.log; it is shown, as its last lines, only when a
# step fails, and the script then exits non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${FAIRSEQ_STREAM_VENV:-.venv}
stamp="$VENV/.fairseq-stream-installed"
# The compiled kernels' sources and target CPU (FAIRSEQ_STREAM_MARCH, setup.py; unset: the x86-64-v3
# baseline) count too: a change rebuilds the extension.
want=$( (cat setup.py pyproject.toml scripts/setup_env.sh $(find fairseq_stream/ops/csrc -type f 2>/dev/null | sort); \
  echo "march=${FAIRSEQ_STREAM_MARCH:-}") | sha1sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

mkdir -p "$VENV"
log="$VENV/setup.log"
: > "$log"

# step CMD...: run CMD with its output appended to the log; if it fails, print
# the command and the log's tail and stop.
step() {
  echo "+ $*" >> "$log"
  local rc=0
  "$@" >> "$log" 2>&1 || rc=$?
  if [ "$rc" -ne 0 ]; then
    {
      echo "fairseq-stream: setup failed (exit $rc): $*"
      echo "---- last 40 lines of $log ----"
      tail -n 40 "$log"
      echo "---- end of $log ----"
    } >&2
    exit "$rc"
  fi
}

if [ -f "$stamp" ]; then
  echo "fairseq-stream: updating $VENV (the kernels' sources or setup changed: rebuilding the kernels)"
else
  echo "fairseq-stream: setting up $VENV (first time: torch, then fairseq-fixed built from source, ~4 min)"
fi
step python3 -m venv "$VENV"
step "$VENV/bin/pip" install --upgrade pip wheel setuptools
# torch first and pinned: a looser requirement would pull a multi-GB CUDA build. ninja lets torch's
# BuildExtension compile the kernels' files on every core (without it, one after another: minutes).
step "$VENV/bin/pip" install torch==2.13.0 numpy==2.4.6 cython ninja==1.13.2
# fairseq-fixed compiles against the torch and numpy above (no build isolation).
step "$VENV/bin/pip" install --no-build-isolation -e '.[test]'
# setup.py stops on a kernel that fails to build; this catches one that was built but does not load
# (without it every fast path would run on torch ops). FAIRSEQ_STREAM_NO_KERNELS=1 skips both.
case "$(echo "${FAIRSEQ_STREAM_NO_KERNELS:-}" | tr 'A-Z' 'a-z')" in
  ""|0|false|no) step "$VENV/bin/python" -c 'import torch, fairseq_stream._ops_cpu' ;;
esac
echo "$want" > "$stamp"
echo "fairseq-stream: environment ready in $VENV (build log: $log)"
