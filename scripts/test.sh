#!/usr/bin/env bash
# The test command: install what is needed, lint, format-check and type-check hand-written
# code, run the whole test suite (unit + integration against real Redis, Triton and gRPC
# servers).
# Extra arguments go to pytest (e.g. scripts/test.sh -k gateway).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
.venv/bin/python scripts/gen_protos.py --check
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
exec .venv/bin/python -m pytest "$@"
