#!/usr/bin/env bash
# Build the container images of gtr-retrieval (names and tags: deploy/images.env).
#
#   scripts/build_images.sh            the CPU images: gtr-retrieval, gtr-retrieval-triton-cpu
#   scripts/build_images.sh --gpu      also gtr-retrieval-gpu and gtr-retrieval-triton
#                                      (needs nvcr.io and PyPI; not buildable without them)
#   scripts/build_images.sh --print    print the image references and exit
#
# With `docker` when a Docker daemon answers, otherwise with `buildah` as root
# (--storage-driver vfs --isolation chroot: no daemon, no overlay or user namespaces needed;
# override with BUILDAH_STORAGE_DRIVER). Python packages come from a wheelhouse that
# `pip wheel` fills on the host from the configured index (the project's wheel, torch
# 2.13.0+cpu and the other pins of pyproject.toml); the image builds need no network.
# The Debian base is the registry's (DEBIAN_BASE) when it can be pulled, otherwise the
# same bookworm made here by `mmdebstrap --variant=minbase` from Debian's packages.
# Base rootfs and wheelhouse are cached under $GTR_IMAGE_CACHE (default
# ~/.cache/gtr-retrieval/images), keyed by what they are made from, so a second run only
# rebuilds the project's wheel and the images. Prints the time of every step.
# GTR_IMAGE_SOURCE=HEAD builds the project's wheel from the last commit (git archive)
# instead of the working tree (the default).
set -euo pipefail

# All in one function: bash reads it whole before running it, so editing this file while
# a build runs cannot change the running build.
main() {
  cd "$(dirname "$0")/.."
  ROOT=$PWD

  gpu=0
  print_only=0
  for arg in "$@"; do
    case "$arg" in
      --gpu) gpu=1 ;;
      --print) print_only=1 ;;
      -h|--help) sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
      *) echo "build_images: unknown argument $arg (see --help)" >&2; exit 2 ;;
    esac
  done

  # shellcheck source=../deploy/images.env
  . deploy/images.env
  ref() { echo "$REGISTRY/$1:$TAG"; }
  APP_REF=$(ref "$APP_IMAGE")
  TRITON_CPU_REF=$(ref "$TRITON_CPU_IMAGE")
  APP_GPU_REF=$(ref "$APP_GPU_IMAGE")
  TRITON_REF=$(ref "$TRITON_IMAGE")
  if [ "$print_only" = 1 ]; then
    printf 'APP=%s\nTRITON_CPU=%s\nAPP_GPU=%s\nTRITON=%s\n' \
      "$APP_REF" "$TRITON_CPU_REF" "$APP_GPU_REF" "$TRITON_REF"
    exit 0
  fi

  PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
  [ -x "$PYTHON" ] || PYTHON=python3.11
  CACHE=${GTR_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gtr-retrieval/images}
  mkdir -p "$CACHE"
  t0=$SECONDS
  step() { echo "build_images: [$((SECONDS - t0)) s] $*"; }

  if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
    engine=docker
  elif command -v buildah >/dev/null 2>&1; then
    engine=buildah
    export STORAGE_DRIVER=${BUILDAH_STORAGE_DRIVER:-vfs}
  else
    echo "build_images: neither a Docker daemon nor buildah (apt-get install buildah)" >&2
    exit 1
  fi
  step "engine: $engine"

  # --- the Debian base ---------------------------------------------------------------------
  BASE_PACKAGES="python3.11,libpython3.11,ca-certificates"
  pull_base() {
    if [ "$engine" = docker ]; then
      timeout 120 docker pull -q "$DEBIAN_BASE" >/dev/null 2>&1
    else
      timeout 120 buildah pull -q "$DEBIAN_BASE" >/dev/null 2>&1
    fi
  }
  base_ref=$DEBIAN_BASE
  if [ "${GTR_IMAGE_LOCAL_BASE:-0}" = 1 ] || ! pull_base; then
    key=$(printf '%s\n' bookworm minbase "$BASE_PACKAGES" | sha256sum | cut -c1-16)
    base_ref=localhost/gtr-retrieval-base:bookworm-$key
    rootfs=$CACHE/rootfs-$key.tar
    if [ ! -s "$rootfs" ]; then
      command -v mmdebstrap >/dev/null 2>&1 \
        || { echo "build_images: no registry base and no mmdebstrap (apt-get install mmdebstrap)" >&2; exit 1; }
      step "mmdebstrap bookworm ($BASE_PACKAGES) -> $rootfs"
      mmdebstrap --quiet --format=tar --variant=minbase --include="$BASE_PACKAGES" bookworm \
        "$rootfs.partial" \
        "deb http://deb.debian.org/debian bookworm main" \
        "deb http://deb.debian.org/debian bookworm-updates main" \
        "deb http://deb.debian.org/debian-security bookworm-security main"
      mv "$rootfs.partial" "$rootfs"
    fi
    if [ "$engine" = docker ]; then
      docker image inspect "$base_ref" >/dev/null 2>&1 || docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD ["/bin/bash"]' "$rootfs" "$base_ref" >/dev/null
    elif ! buildah inspect --type image "$base_ref" >/dev/null 2>&1; then
      ctr=$(buildah from scratch)
      buildah add --quiet "$ctr" "$rootfs" / >/dev/null
      buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --cmd /bin/bash "$ctr"
      buildah commit --quiet --rm "$ctr" "$base_ref" >/dev/null
    fi
    step "base: $base_ref (mmdebstrap, cached as $rootfs)"
  else
    step "base: $base_ref (pulled)"
  fi

  # --- the wheelhouse ----------------------------------------------------------------------
  # Wheels the images' Python (Debian's 3.11.2) needs beyond what pip resolves for the host's:
  # redis requires async-timeout below Python 3.11.3.
  EXTRA_WHEELS="async-timeout==5.0.1"
  # Dependencies: keyed by pyproject.toml (the pins); the project's own wheel is rebuilt on
  # every run. Exactly one version of each package, never a CUDA build for the CPU images.
  fill_wheelhouse() {  # DIR EXTRA
    local dir=$1 extra=$2 key deps
    # The pins only, the SDK's included (other edits of the pyproject.toml files keep the cache).
    key=$( { "$PYTHON" -c 'import json, sys, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; c = tomllib.load(open("clients/python/pyproject.toml", "rb"))["project"]; print(json.dumps([p["dependencies"], p["optional-dependencies"][sys.argv[1]], c["dependencies"]]))' "$extra"
             echo "$EXTRA_WHEELS"; "$PYTHON" -m pip --version | cut -d" " -f2; } | sha256sum | cut -c1-16)
    deps=$CACHE/wheels-$extra-$key
    if [ ! -f "$deps/.complete" ]; then
      step "pip wheel: dependencies of .[$extra] -> $deps"
      rm -rf "$deps"
      if [ "$extra" = cpu ]; then
        # shellcheck disable=SC2086
        "$PYTHON" -m pip wheel -q --wheel-dir "$deps" pip "torch==2.13.0" ./clients/python ".[cpu]" $EXTRA_WHEELS \
          2> >(grep -v '^WARNING: Location' >&2)
        # CUDA runtime wheels (nvidia_cublas_cu12, ...; not nvidia_pytriton) or a torch
        # that is not the +cpu build
        cuda=$(ls "$deps" | { grep -iE '^nvidia_' || true; } | { grep -viE '^nvidia_pytriton-' || true; })
        cuda+=$(ls "$deps" | { grep -E '^torch-' || true; } | { grep -v '+cpu' || true; })
        if [ -n "$cuda" ]; then
          echo "build_images: a CUDA build reached the CPU wheelhouse: $cuda" >&2
          exit 1
        fi
      else
        "$PYTHON" -m pip wheel -q --no-deps --wheel-dir "$deps" pip
      fi
      rm -f "$deps"/gtr_retrieval-*.whl "$deps"/gtr_retrieval_client-*.whl
      touch "$deps/.complete"
    fi
    rm -rf "$dir"
    mkdir -p "$dir"
    cp -al "$deps"/*.whl "$dir"/ 2>/dev/null || cp "$deps"/*.whl "$dir"/
    local src=.
    if [ "${GTR_IMAGE_SOURCE:-worktree}" = HEAD ]; then
      src=$(mktemp -d)
      git archive HEAD | tar -x -C "$src"
    fi
    # The project's wheel and the SDK's (the wire contract, `retrieval`, which it depends on).
    for pkg in "$src/clients/python" "$src"; do
      "$PYTHON" -m pip wheel -q --no-deps --no-build-isolation --wheel-dir "$dir" "$pkg" \
        2> >(grep -v '^WARNING: Location' >&2) \
        || "$PYTHON" -m pip wheel -q --no-deps --wheel-dir "$dir" "$pkg"
    done
    [ "$src" = . ] || rm -rf "$src"
    step "wheelhouse $dir: $(ls "$dir" | wc -l) wheels"
  }
  fill_wheelhouse build/wheels/cpu cpu
  [ "$gpu" = 1 ] && fill_wheelhouse build/wheels/gpu gpu

  # --- the images --------------------------------------------------------------------------
  revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)
  created=$(date -u +%Y-%m-%dT%H:%M:%SZ)
  # An image is rebuilt only when what it is made from changed: its Dockerfile, the files
  # it copies, the base, the wheelhouse and (for the application images) the project's
  # source. The key is the image's label io.gtr-retrieval.build-key.
  source_hash=$( { git ls-tree -r HEAD -- services clients/python pyproject.toml 2>/dev/null
                   if [ "${GTR_IMAGE_SOURCE:-worktree}" != HEAD ]; then
                     git diff HEAD -- services clients/python pyproject.toml 2>/dev/null
                     git ls-files -o --exclude-standard -- services clients/python 2>/dev/null \
                       | xargs -r sha256sum
                   fi; } | sha256sum | cut -c1-16)
  existing_key() {
    if [ "$engine" = docker ]; then
      docker image inspect --format '{{index .Config.Labels "io.gtr-retrieval.build-key"}}' "$1"
    else
      buildah inspect --type image --format \
        '{{index .Docker.Config.Labels "io.gtr-retrieval.build-key"}}' "$1"
    fi 2>/dev/null || true
  }
  build() {  # DOCKERFILE REF WHEELHOUSE [--build-arg ...]
    local file=$1 tag=$2 wheels=$3 key
    shift 3
    key=$( { cat "$file" deploy/docker/healthcheck.py deploy/docker/check_cuda.py; echo "$base_ref $*"
             ls "$wheels" 2>/dev/null | grep -v '^gtr_retrieval\(_client\)\?-'
             if grep -q 'gtr-retrieval\[' "$file"; then echo "$source_hash"; fi; } \
           | sha256sum | cut -c1-16)
    if [ "$(existing_key "$tag")" = "$key" ]; then
      step "up to date: $tag (build key $key)"
      return
    fi
    step "build $tag ($file)"
    local args=(-f "$file" -t "$tag" --build-arg "VERSION=$TAG" --build-arg "REVISION=$revision"
      --build-arg "CREATED=$created" --label "io.gtr-retrieval.build-key=$key" "$@")
    local old
    if [ "$engine" = docker ]; then
      old=$(docker image inspect --format '{{.Id}}' "$tag" 2>/dev/null || true)
      DOCKER_BUILDKIT=1 docker build "${args[@]}" .
      [ -z "$old" ] || [ "$old" = "$(docker image inspect --format '{{.Id}}' "$tag")" ] \
        || docker rmi "$old" >/dev/null 2>&1 || true
    else
      old=$(buildah inspect --type image --format '{{.FromImageID}}' "$tag" 2>/dev/null || true)
      # --layers=false: one layer per stage (with vfs every layer is a full copy of the tree).
      buildah bud --quiet --isolation chroot --layers=false --force-rm --format docker "${args[@]}" .
      # the image this one replaces (untagged now): with vfs it holds gigabytes
      [ -z "$old" ] || [ "$old" = "$(buildah inspect --type image --format '{{.FromImageID}}' "$tag")" ] \
        || buildah rmi "$old" >/dev/null 2>&1 || true
    fi
  }
  build deploy/docker/gtr-retrieval.Dockerfile "$APP_REF" build/wheels/cpu \
    --build-arg "BASE_IMAGE=$base_ref"
  build deploy/docker/triton-cpu.Dockerfile "$TRITON_CPU_REF" build/wheels/cpu \
    --build-arg "BASE_IMAGE=$base_ref"
  if [ "$gpu" = 1 ]; then
    build deploy/docker/gtr-retrieval-gpu.Dockerfile "$APP_GPU_REF" build/wheels/gpu \
      --build-arg "BASE_IMAGE=$base_ref"
    build deploy/docker/triton.Dockerfile "$TRITON_REF" build/wheels/gpu \
      --build-arg "TRITON_IMAGE=$TRITON_BASE"
  fi
  step "done: $APP_REF $TRITON_CPU_REF$([ "$gpu" = 1 ] && echo " $APP_GPU_REF $TRITON_REF")"
}

main "$@"
