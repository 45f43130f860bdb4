#!/usr/bin/env bash
# The README's first command: set up .venv, build the toy checkpoints, and
# decode the same built-in toy input (the 200-sentence valid set) with
# fairseq's beam search, with var-stream and with greedy, printing BLEU, wall
# clock and the speedup over beam side by side (scripts/compare_searches.py).
#   bash scripts/quickstart.sh [TOY_DIR]     (default: toy/)
# A second run skips the set-up (stamp in .venv) and the training (TOY_DIR/DONE).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
VENV=${FAIRSEQ_STREAM_VENV:-.venv}
export PATH="$PWD/$VENV/bin:$PATH"
TOY=${1:-toy}

if [ ! -f "$TOY/DONE" ]; then
  echo "fairseq-stream: training the toy checkpoints into $TOY/ (about a minute each)"
  mkdir -p "$TOY"
  bash scripts/train_toy.sh "$TOY" > "$TOY/train.log" 2>&1 || { tail -30 "$TOY/train.log"; exit 1; }
else
  echo "fairseq-stream: toy checkpoints found in $TOY/ (delete $TOY/DONE to retrain)"
fi

echo "fairseq-stream: decoding with --search beam, var-stream and greedy (3 rounds of fairseq-generate, about a minute)"
"$VENV/bin/python" scripts/compare_searches.py "$TOY"
