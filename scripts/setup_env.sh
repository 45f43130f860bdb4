#!/usr/bin/env bash
# Create the project's virtual environment (.venv, or $FAIRSEQ_STREAM_VENV) with
# torch, fairseq-fixed and fairseq-stream installed. Idempotent: a stamp holding
# the hash of setup.py skips the work when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${FAIRSEQ_STREAM_VENV:-.venv}
stamp="$VENV/.fairseq-stream-installed"
want=$(cat setup.py scripts/setup_env.sh | sha1sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

# pip's site configuration lists local wheel folders that may be missing; its
# warnings about them are noise here.
quiet_pip() {
  local rc=0
  "$VENV/bin/pip" "$@" > >(grep -v '^WARNING: Location' >&2) 2>&1 || rc=$?
  return $rc
}

echo "fairseq-stream: setting up $VENV (first time: torch, then fairseq-fixed built from source, ~4 min)"
python3 -m venv "$VENV"
quiet_pip install -q --upgrade pip wheel setuptools
# torch first and pinned: a looser requirement would pull a multi-GB CUDA build.
quiet_pip install -q torch==2.13.0 numpy==2.4.6 cython
# fairseq-fixed compiles against the torch and numpy above (no build isolation).
quiet_pip install -q --no-build-isolation -e '.[test]'
echo "$want" > "$stamp"
echo "fairseq-stream: environment ready in $VENV"
