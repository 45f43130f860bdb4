#!/usr/bin/env bash
# Train the small real Multi30k De-En models used by the benchmarks.
#   bash scripts/train_multi30k.sh DATA_DIR OUT_DIR [--lstm]
# DATA_DIR: raw Multi30k text (train.de/.en, val.*, test_2016_flickr.*).
# OUT_DIR gets spm/ (sentencepiece model + pieces), data-bin/, transformer/
# and, with --lstm, lstm/. Deterministic (fixed seeds, fixed thread count);
# 1,200 updates (~9 epochs): 45 minutes on 2 busy CPU cores here. Uses the tools on
# PATH (activate .venv first).
set -euo pipefail
if [ $# -lt 2 ]; then echo "usage: $0 DATA_DIR OUT_DIR [--lstm]" >&2; exit 2; fi
DATA=$1; OUT=$2; WITH_LSTM=${3:-}
HERE=$(cd "$(dirname "$0")" && pwd)
for f in train.de train.en; do  # before OUT_DIR is made: a mistyped DATA_DIR left OUT_DIR/spm and a traceback
  if [ ! -f "$DATA/$f" ] && [ ! -f "$OUT/spm/spm.model" ]; then
    echo "train_multi30k.sh: $DATA: no $f (DATA_DIR is the raw Multi30k text)" >&2; exit 2
  fi
done
export OMP_NUM_THREADS=${TRAIN_THREADS:-2} MKL_NUM_THREADS=${TRAIN_THREADS:-2}
mkdir -p "$OUT"

if [ ! -f "$OUT/spm/spm.model" ]; then
  python "$HERE/spm_prepare.py" "$DATA" "$OUT/spm" --vocab 8000
fi
if [ ! -f "$OUT/data-bin/dict.en.txt" ]; then
  fairseq-preprocess --source-lang de --target-lang en \
    --trainpref "$OUT/spm/train" --validpref "$OUT/spm/valid" --testpref "$OUT/spm/test" \
    --destdir "$OUT/data-bin" --joined-dictionary --workers 1
fi

# --user-dir makes fairseq-train's own checkpoint reloads (restarts) load safely on torch 2.13.
COMMON=(--user-dir "$HERE/../fairseq_stream" --cpu --seed 1 --num-workers 0
  --optimizer adam --adam-betas '(0.9,0.98)' --clip-norm 0.0
  --lr-scheduler inverse_sqrt --criterion label_smoothed_cross_entropy --label-smoothing 0.1
  --max-tokens 4096 --no-epoch-checkpoints --log-format simple --log-interval 100)

if [ ! -f "$OUT/transformer/DONE" ]; then
  fairseq-train "$OUT/data-bin" "${COMMON[@]}" --save-dir "$OUT/transformer" \
    --arch transformer --share-all-embeddings \
    --encoder-layers 3 --decoder-layers 3 --encoder-embed-dim 256 --decoder-embed-dim 256 \
    --encoder-ffn-embed-dim 512 --decoder-ffn-embed-dim 512 \
    --encoder-attention-heads 4 --decoder-attention-heads 4 \
    --dropout 0.2 --weight-decay 0.0001 --lr 1e-3 --warmup-updates 300 \
    --max-update ${TRANSFORMER_UPDATES:-1200}
  touch "$OUT/transformer/DONE"
fi

if [ "$WITH_LSTM" = "--lstm" ] && [ ! -f "$OUT/lstm/DONE" ]; then
  fairseq-train "$OUT/data-bin" "${COMMON[@]}" --save-dir "$OUT/lstm" \
    --arch lstm --share-all-embeddings --encoder-embed-dim 256 --decoder-embed-dim 256 \
    --decoder-out-embed-dim 256 --encoder-hidden-size 256 --decoder-hidden-size 256 \
    --encoder-layers 1 --decoder-layers 1 --dropout 0.2 --lr 1e-3 --warmup-updates 500 \
    --max-update ${LSTM_UPDATES:-1200}
  touch "$OUT/lstm/DONE"
fi
echo "done: $OUT"
