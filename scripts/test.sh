#!/usr/bin/env bash
# Set up .venv (CPU recipe) if needed, lint, then run the test suite (GPU tests skip).
# Extra arguments go to pytest, e.g. scripts/test.sh -m "not e2e" -x
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source scripts/env.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest "$@"
