#!/usr/bin/env bash
# The streaming paper's Table 1: newstest.sh over pairs x methods x beams, repeated, then the tables.
#
#   scripts/newstest_all.sh [--pairs de-en ru-en] [--year 2018] [--methods greedy beam var-batch var-stream]
#                           [--beams 5 50] [--runs 5] [--wmt19-dir DIR] [--text-dir-root DIR]
#                           [--results FILE] [--report-dir DIR] [newstest.sh options] [-- fairseq-generate options]
#
# Results: one JSON line per run appended to --results (default results/newstest_table1.jsonl, relative
# to the current directory; results/ is git-ignored in this repository), labelled with this grid run's ID;
# report.md and PNG plots of this grid run's rows in --report-dir (default results/table1).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${FAIRSEQ_STREAM_VENV:-$ROOT/.venv}
PY=python3
[ -x "$VENV/bin/python" ] && PY="$VENV/bin/python"
# fairseq's import-time notes (optional packages) are not this tool's output; FAIRSEQ_STREAM_VERBOSE=1 shows them.
exec "$PY" -c 'import logging, os
if os.environ.get("FAIRSEQ_STREAM_VERBOSE", "") in ("", "0"): logging.getLogger("fairseq").setLevel(logging.WARNING)
from fairseq_stream.newstest.table import main; main()' "$@"
