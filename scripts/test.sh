#!/usr/bin/env bash
# The test command: set up the environment if needed, then run the test suite.
# Extra arguments go to pytest (e.g. -k beam, -m cuda).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
VENV=${FAIRSEQ_STREAM_VENV:-.venv}
# Two workers (pytest-xdist): most tests wait on one CPU core each, and CI has
# two. FAIRSEQ_STREAM_TEST_WORKERS=0 runs them in this process (or pass -n 0).
# worksteal: a worker that runs dry takes tests queued on the other, so one long
# test near the end does not leave a core idle. Tests marked slow are skipped
# (conftest.py); -m slow or FAIRSEQ_STREAM_SLOW=1 runs them.
exec "$VENV/bin/python" -m pytest tests -n "${FAIRSEQ_STREAM_TEST_WORKERS:-2}" --dist worksteal "$@"
