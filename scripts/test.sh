#!/usr/bin/env bash
# The test command: install what is needed, lint, format-check and type-check hand-written
# code, run the test suite (unit + integration against real Redis, Triton and gRPC servers).
#
#   scripts/test.sh           everything, as CI runs it (.ci/run)
#   scripts/test.sh --fast    the inner loop: the same checks, then every test not marked
#                             `slow`, spread over the machine's cores (pytest-xdist)
#
# Extra arguments go to pytest (e.g. scripts/test.sh --fast -k gateway).
# Both tiers run the test files in parallel, one file per worker at a time (--dist loadfile:
# the servers a module starts are shared by its tests). GTR_TEST_WORKERS sets the number of
# workers (default: the CPUs this process may use, at most 2 in CI's budget; 0 runs serially).
set -euo pipefail
cd "$(dirname "$0")/.."

tier=all
if [ "${1:-}" = "--fast" ]; then
  tier=fast
  shift
fi

scripts/bootstrap.sh
.venv/bin/python scripts/gen_protos.py --check
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy

cpus=$(.venv/bin/python -c 'import os; print(len(os.sched_getaffinity(0)))')
workers=${GTR_TEST_WORKERS:-$(( cpus < 2 ? cpus : 2 ))}
parallel=()
if [ "$workers" -gt 1 ]; then
  parallel=(-n "$workers" --dist loadfile)
fi

start=$(date +%s)
status=0
if [ "$tier" = fast ]; then
  .venv/bin/python -m pytest "${parallel[@]}" -m "not slow" "$@" || status=$?
else
  .venv/bin/python -m pytest "${parallel[@]}" "$@" || status=$?
fi
echo "scripts/test.sh ($tier): pytest took $(( $(date +%s) - start )) s with ${workers} worker(s)"
exit "$status"
