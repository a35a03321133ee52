#!/usr/bin/env bash
# The test command: install what is needed, lint, format-check and type-check hand-written
# code, run the test suite (unit + integration against real Redis, Triton and gRPC servers).
#
#   scripts/test.sh           everything, as CI runs it (.ci/run): the fast tier as below,
#                             then the tests marked `slow` the same way, then the few also
#                             marked `serial` one at a time (their assertions are about
#                             latency or load: a second worker beside them would be load
#                             they do not budget for)
#   scripts/test.sh --fast    the inner loop: the same checks, then every test not marked
#                             `slow`, spread over the CPUs (pytest-xdist, --dist loadfile: a
#                             module's servers stay shared by its tests)
#
# Extra arguments go to pytest (e.g. scripts/test.sh --fast -k gateway). GTR_TEST_WORKERS
# sets the fast tier's workers (default: the CPUs this process may use, at most 2; 1 runs
# it serially).
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
  # One OpenMP thread per worker: with OpenMP's default (a thread per CPU) in each of two
  # workers, faiss's threads spin-wait for cores the other worker holds; two concurrent
  # index trainings took 17 s each that way and 4.4-5.4 s with one thread each.
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi

# pytest's exit status 5 is "no test collected" (a -k that selects none in one tier);
# --durations: each tier's slowest tests end its log (what to look at when CI grows)
run() { .venv/bin/python -m pytest --durations=15 "$@" || { rc=$?; [ "$rc" -eq 5 ] || return "$rc"; }; }

start=$(date +%s)
status=0
run "${parallel[@]}" -m "not slow" "$@" || status=$?
fast_s=$(( $(date +%s) - start ))
echo "scripts/test.sh: the fast tier took ${fast_s} s of pytest with ${workers} worker(s)"
if [ "$tier" = all ]; then
  # the slow tests mostly wait (restarts, rollouts, timeouts): in parallel too, except the
  # few marked serial, whose assertions are about latency or load and budget for no
  # neighbour
  run "${parallel[@]}" -m "slow and not serial" "$@" || status=$?
  slow_s=$(( $(date +%s) - start - fast_s ))
  echo "scripts/test.sh: the slow tier took ${slow_s} s of pytest"
  run -m serial "$@" || status=$?
  echo "scripts/test.sh: the serial tier took $(( $(date +%s) - start - fast_s - slow_s )) s"
fi
exit "$status"
