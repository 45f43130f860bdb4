#!/usr/bin/env bash
# The README's first command: set up .venv, build the toy checkpoints, and
# decode the same built-in toy input (the 200-sentence valid set) with
# fairseq's beam search, with var-stream and with greedy, printing BLEU, wall
# clock and the speedup over beam side by side (scripts/compare_searches.py).
#   bash scripts/quickstart.sh [--verbose] [TOY_DIR]     (default: toy/)
# Only our own lines are printed: pip's output goes to .venv/setup.log, the toy's training to
# TOY_DIR/train.log and each fairseq-generate run's output to TOY_DIR/compare/SEARCH.log.
# --verbose (or FAIRSEQ_STREAM_VERBOSE=1) prints fairseq-generate's output too.
# A second run skips the set-up (stamp in .venv) and the toy (TOY_DIR/DONE). The toy is trained once
# per machine into the cache shared with the test suite (scripts/toy_cache.py says where) and copied
# into TOY_DIR; delete that cache folder to train it again.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
VENV=${FAIRSEQ_STREAM_VENV:-.venv}
export PATH="$PWD/$VENV/bin:$PATH"
if [ "${1:-}" = "--verbose" ]; then
  export FAIRSEQ_STREAM_VERBOSE=1
  shift
fi
TOY=${1:-toy}

if [ ! -f "$TOY/DONE" ]; then
  # Trained once per machine into the cache the test suite uses too (trained there
  # already by a test run, it is only copied); the training's output goes to $TOY/train.log.
  mkdir -p "$TOY"
  "$VENV/bin/python" scripts/toy_cache.py --copy-to "$TOY" --log "$TOY/train.log" > /dev/null
else
  echo "fairseq-stream: toy checkpoints found in $TOY/ (delete $TOY/DONE to copy them again from the cache" \
    "where they are trained once per machine: python scripts/toy_cache.py prints it)"
fi

echo "fairseq-stream: decoding with --search beam, var-stream and greedy (3 rounds of fairseq-generate, about a minute)"
"$VENV/bin/python" scripts/compare_searches.py "$TOY"
