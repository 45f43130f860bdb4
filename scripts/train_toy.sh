#!/usr/bin/env bash
# Build the synthetic toy translation task and train tiny fairseq models on it.
#
# Usage: bash scripts/train_toy.sh OUT_DIR
#
# Uses `python`, `fairseq-preprocess` and `fairseq-train` from PATH (the caller
# is expected to have activated the environment). Produces:
#   OUT_DIR/raw/{train,valid,test}.{src,tgt}   plain text (make_toy_data.py)
#   OUT_DIR/data-bin/                         binarized data, joined dictionary
#   OUT_DIR/transformer/checkpoint_best.pt    tiny transformer, seed 1
#   OUT_DIR/transformer2/checkpoint_best.pt   same arch, seed 2 (for ensembles)
#   OUT_DIR/transformer{3,4}/checkpoint_best.pt  same arch, seeds 3 and 4, 2 epochs (4-member ensembles)
#   OUT_DIR/lstm/checkpoint_best.pt           tiny attentional LSTM
#   OUT_DIR/DONE                              written only after all succeeded
#
# Everything is rebuilt from scratch on each run; training is deterministic
# (fixed seeds, CPU, single thread, no data-loader workers).
set -euo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: $0 OUT_DIR" >&2
    exit 2
fi

OUT_DIR=$1
SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# One thread: bitwise reproducibility depends on the thread count, and with
# 2 threads a concurrently running process (e.g. parallel tests) makes OpenMP
# oversubscribe the CPU and slows training down several times; a single thread
# is only ~30% slower on an idle 2-core machine.
export OMP_NUM_THREADS=1
export MKL_NUM_THREADS=1

rm -f "$OUT_DIR/DONE"
# fairseq-preprocess refuses to overwrite an existing dictionary, and
# fairseq-train would resume from leftovers, so start from a clean slate.
rm -rf "$OUT_DIR/raw" "$OUT_DIR/data-bin" \
    "$OUT_DIR/transformer" "$OUT_DIR/transformer2" "$OUT_DIR/transformer3" "$OUT_DIR/transformer4" \
    "$OUT_DIR/lstm"
mkdir -p "$OUT_DIR"

python "$SCRIPT_DIR/make_toy_data.py" "$OUT_DIR/raw" --seed 1

fairseq-preprocess \
    --source-lang src --target-lang tgt \
    --joined-dictionary \
    --trainpref "$OUT_DIR/raw/train" \
    --validpref "$OUT_DIR/raw/valid" \
    --testpref "$OUT_DIR/raw/test" \
    --destdir "$OUT_DIR/data-bin" \
    --workers 1

# Options shared by all models. Validation stays enabled because fairseq only
# writes checkpoint_best.pt after a validation run; epoch and last checkpoints
# are disabled, so checkpoint_best.pt is the only file written. Small batches
# (many updates) learn this task much faster per second than large ones.
COMMON=(
    "$OUT_DIR/data-bin"
    --cpu
    --num-workers 0
    --optimizer adam --adam-betas "(0.9,0.98)"
    --lr 5e-3 --lr-scheduler inverse_sqrt --warmup-updates 100
    --dropout 0.0
    --criterion label_smoothed_cross_entropy --label-smoothing 0.1
    --max-tokens 512
    --no-epoch-checkpoints --no-last-checkpoints
    --log-format simple --log-interval 50
)

# Default (sinusoidal) positions: on this task they learn faster than learned
# positions (BLEU ~46 vs ~24 after 5 epochs).
TRANSFORMER=(
    --arch transformer
    --share-all-embeddings
    --encoder-layers 2 --decoder-layers 2
    --encoder-embed-dim 64 --decoder-embed-dim 64
    --encoder-ffn-embed-dim 128 --decoder-ffn-embed-dim 128
    --encoder-attention-heads 4 --decoder-attention-heads 4
)

# A bidirectional encoder gives each source state its right neighbour, which
# the modifier swap needs; with a unidirectional one the loss does not move
# within this budget.
LSTM=(
    --arch lstm
    --encoder-bidirectional
    --encoder-layers 1 --decoder-layers 1
    --encoder-embed-dim 64 --decoder-embed-dim 64 --decoder-out-embed-dim 64
    --encoder-hidden-size 128 --decoder-hidden-size 128
)

# train NAME SEED MAX_EPOCH ARCH_ARGS...
train() {
    local name=$1 seed=$2 max_epoch=$3
    shift 3
    local start=$SECONDS
    fairseq-train "${COMMON[@]}" "$@" \
        --seed "$seed" --max-epoch "$max_epoch" \
        --save-dir "$OUT_DIR/$name" | sed -u "s/^/[$name] /"
    if [[ ! -f "$OUT_DIR/$name/checkpoint_best.pt" ]]; then
        echo "error: $OUT_DIR/$name/checkpoint_best.pt was not written" >&2
        exit 1
    fi
    echo "train_toy: trained $name in $((SECONDS - start)) s" >&2
}

# Epoch counts keep each model under a minute of training on one core; the
# LSTM converges in 3 epochs (a 4th one made the validation loss worse).
# Members 3 and 4 of the 4-member toy ensemble (the stacked-members tests, docs/ensemble.md): the tests
# compare two ways of running the same members, which need only be distinct and decode sensibly, so
# 2 epochs each (about 20 s each on one core) rather than a converged model.
#
# Each model trains on one thread from its own seed, so two at a time on two cores train the same
# checkpoints in about half the time (the suite's first minutes wait on them): two lanes of about equal
# length, each line of fairseq-train's log (its stdout) labelled with its model. One core: the lanes one after
# the other.
lane_a() {
    train transformer 1 6 "${TRANSFORMER[@]}"
    train transformer3 3 2 "${TRANSFORMER[@]}"
    train transformer4 4 2 "${TRANSFORMER[@]}"
}
lane_b() {
    train lstm 1 3 "${LSTM[@]}"
    train transformer2 2 5 "${TRANSFORMER[@]}"
}
# nproc counts the cores this process may use, but honours OMP_NUM_THREADS (set to 1 above): unset it there.
if [[ $(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc) -ge 2 ]]; then
    # Each lane in a process group of its own (job control on while they start), so that a lane still
    # running when this script stops (the other lane's error, Ctrl-C, the caller's kill) is stopped with
    # its fairseq-train.
    set -m
    lane_a & a=$!
    lane_b & b=$!
    set +m
    trap 'kill -- -$a -$b 2>/dev/null || true' EXIT
    # Ctrl-C reaches this script's process group only: stop waiting, and the EXIT trap stops the lanes.
    trap 'exit 130' INT
    trap 'exit 143' TERM
    for _ in 1 2; do
        status=0
        wait -n || status=$?  # whichever lane ends first: a failure stops the other at once
        if [[ $status -ne 0 ]]; then
            exit $status
        fi
    done
    trap - EXIT INT TERM
else
    lane_a
    lane_b
fi

touch "$OUT_DIR/DONE"
