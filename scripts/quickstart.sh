#!/usr/bin/env bash
# The README's first command: set up .venv, build the toy checkpoints, and
# translate the built-in example with the plugin loaded, printing the
# translations and fairseq's sacreBLEU line.
#   bash scripts/quickstart.sh [TOY_DIR]     (default: toy/)
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
fi

echo "fairseq-stream: translating $TOY/raw/test.src with --search beam"
fairseq-generate "$TOY/data-bin" --path "$TOY/transformer/checkpoint_best.pt" \
  --user-dir fairseq_stream --search beam --beam 5 --gen-subset test \
  --batch-size 16 --scoring sacrebleu --cpu --log-format simple 2> "$TOY/generate.log" \
  | tee "$TOY/generate.out" | grep -E '^(S|H)-|^Generate'
grep -h "Translated" "$TOY/generate.log" | sed 's/^.*| //'
