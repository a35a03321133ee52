#!/usr/bin/env bash
# Install everything the project needs on a fresh Debian machine; safe to run again.
#   - Debian packages: redis-server (document store + change log), prometheus (promtool),
#     buildah + mmdebstrap (scripts/build_images.sh builds the container images without a
#     Docker daemon; tests/e2e/test_images.py runs them)
#   - .venv/ in the project root: torch 2.13.0 CPU first (so nothing pulls a CUDA build),
#     then the SDK (clients/python: the generated wire contract `retrieval` and `gtr_client`,
#     which the project depends on; not on PyPI), then the project with its dev tools,
#     pinned in pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."

# The three installs share nothing (Debian's packages, .venv's packages, checkov's venv)
# and mostly wait on the network: apt's and checkov's run in the background beside the
# project's, each logging to a file that is printed if it fails (on CI's fresh machine the
# bootstrap, one after the other, took ~6 of its 35 minutes).
logs=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$logs"' EXIT
jobs_started=()

missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v buildah >/dev/null 2>&1 || missing+=(buildah)
command -v mmdebstrap >/dev/null 2>&1 || missing+=(mmdebstrap)
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  echo "bootstrap: apt-get install ${missing[*]}"
  {
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
      "${missing[@]}"
  } >"$logs/apt" 2>&1 &
  jobs_started+=("$!:apt")
fi

python=${PYTHON:-python3.11}
command -v "$python" >/dev/null 2>&1 || python=python3

# checkov (policy checks of the rendered Helm chart) pins old packaging/networkx: it gets
# a venv of its own inside .venv/ so that it cannot downgrade the project's packages.
if [ ! -x .venv/tools/checkov/bin/checkov ]; then
  echo "bootstrap: installing checkov into .venv/tools/checkov"
  mkdir -p .venv/tools
  {
    "$python" -m venv .venv/tools/checkov
    .venv/tools/checkov/bin/pip install -q "checkov==3.3.30"
  } >"$logs/checkov" 2>&1 &
  jobs_started+=("$!:checkov")
fi

if [ ! -x .venv/bin/python ]; then
  echo "bootstrap: creating .venv with $($python --version)"
  "$python" -m venv .venv
fi

# Reinstall only when the dependency pins (the project's or the SDK's) changed.
stamp=.venv/.gtr-installed
want=$(cat pyproject.toml clients/python/pyproject.toml | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "bootstrap: installing Python packages into .venv (torch 2.13.0 CPU first)"
  .venv/bin/pip install -q "torch==2.13.0"
  .venv/bin/pip install -q -e clients/python
  .venv/bin/pip install -q -e ".[cpu,dev]"
  if .venv/bin/pip list 2>/dev/null | grep -qiE '^nvidia-(cublas|cudnn|cuda-runtime)'; then
    echo "bootstrap: a CUDA build of a dependency was pulled in; refusing" >&2
    exit 1
  fi
  echo "$want" > "$stamp"
fi

failed=0
for job in "${jobs_started[@]}"; do
  if ! wait "${job%%:*}"; then
    echo "bootstrap: the ${job#*:} install failed:" >&2
    tail -n 30 "$logs/${job#*:}" | cut -c1-400 >&2
    failed=1
  fi
done
exit "$failed"
