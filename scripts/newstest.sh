#!/usr/bin/env bash
# Translate newstestYEAR with one method, score it with sacreBLEU, append a JSON line.
#
#   scripts/newstest.sh PAIR YEAR METHOD [options] [-- fairseq-generate options]
#   scripts/newstest.sh de-en 2018 var-stream --beam 50 --text-dir DATA/wmt/de-en
#
# METHOD is a --preset name (greedy, beam = fairseq's own, fixed, var-batch,
# var-stream, var-fifo, fixed-stream, topup, jacobi, ...). The model defaults
# to $WMT19_DIR/NAME as scripts/download_wmt19.sh unpacks it; --help lists
# the options, including the offline mode for any local model.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${FAIRSEQ_STREAM_VENV:-$ROOT/.venv}
PY=python3
[ -x "$VENV/bin/python" ] && PY="$VENV/bin/python"
# fairseq's import-time notes (optional packages) are not this tool's output; FAIRSEQ_STREAM_VERBOSE=1 shows them.
exec "$PY" -c 'import logging, os
if os.environ.get("FAIRSEQ_STREAM_VERBOSE", "") in ("", "0"): logging.getLogger("fairseq").setLevel(logging.WARNING)
from fairseq_stream.newstest.run import main; main()' "$@"
