#!/usr/bin/env bash
# The test command: set up the environment if needed, then run the test suite.
# Extra arguments go to pytest (e.g. -k beam, -m slow).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
VENV=${FAIRSEQ_STREAM_VENV:-.venv}
exec "$VENV/bin/python" -m pytest tests "$@"
