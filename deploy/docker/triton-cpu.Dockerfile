# syntax=docker/dockerfile:1
# Triton Inference Server for clusters without GPUs (and for the tests here): the
# `tritonserver` that the nvidia-pytriton wheel ships (Triton 2.x built for manylinux, with
# the Python backend), plus exactly what our Python-backend models import
# (services/encoder/build/triton_models/*.py: numpy, onnxruntime, tokenizers; the model
# repository carries textcodec.py and model_errors.py itself). Serves the CPU flavour of
# the repository that `gtr-retrieval encoder repo --flavor cpu` writes, with the same
# command line as NVIDIA's image: `tritonserver --model-repository=...`, backends under
# /opt/tritonserver/backends, HTTP 8000 (/v2/health/ready, /v2/health/live), gRPC 8001,
# metrics 8002. Built by scripts/build_images.sh from the CPU wheelhouse (build/wheels/cpu,
# the application image's: it holds exactly one version of each package, pyproject's pins).

ARG BASE_IMAGE=docker.io/library/debian:bookworm-20250520-slim

FROM ${BASE_IMAGE} AS base
# hadolint ignore=DL3008
RUN dpkg-query -W python3.11 libpython3.11 ca-certificates >/dev/null 2>&1 \
    || { apt-get update \
         && apt-get install -y --no-install-recommends python3.11 libpython3.11 ca-certificates \
         && rm -rf /var/lib/apt/lists/*; }

FROM base AS build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# nvidia-pytriton without its dependencies: only its tritonserver binary, Python backend and
# backend stubs are used, never its Python API. The stub of Python 3.11 goes beside
# libtriton_python.so, where tritonserver looks for the `python` backend.
RUN --mount=type=bind,source=build/wheels/cpu,target=/wheels \
    python3.11 -m venv --without-pip /opt/venv \
    && PIP_WHEEL="$(ls /wheels/pip-*.whl)" \
    && PIP="/opt/venv/bin/python $PIP_WHEEL/pip" \
    && $PIP install --no-index --find-links=/wheels --no-cache-dir --disable-pip-version-check \
         numpy onnxruntime tokenizers \
    && $PIP install --no-index --find-links=/wheels --no-cache-dir --disable-pip-version-check \
         --no-deps nvidia-pytriton \
    && SERVER=/opt/venv/lib/python3.11/site-packages/pytriton/tritonserver \
    && install -d /opt/tritonserver/bin /opt/tritonserver/backends/python \
    && ln -s "$SERVER/bin/tritonserver" /opt/tritonserver/bin/tritonserver \
    && cp "$SERVER/backends/python/libtriton_python.so" \
          "$SERVER/backends/python/triton_python_backend_utils.py" \
          "$SERVER/python_backend_stubs/3.11/triton_python_backend_stub" \
          /opt/tritonserver/backends/python/ \
    && rm -rf "$SERVER/python_backend_stubs" "$SERVER/backends" /opt/venv/lib/python3.11/site-packages/pytriton/[!t]* \
    && export LD_LIBRARY_PATH=/opt/venv/lib/python3.11/site-packages/nvidia_pytriton.libs \
    && ! { ldd /opt/tritonserver/bin/tritonserver \
              /opt/tritonserver/backends/python/libtriton_python.so \
              /opt/tritonserver/backends/python/triton_python_backend_stub || true; } \
         | grep "not found" \
    && { /opt/tritonserver/bin/tritonserver --help 2>&1 || true; } \
         | grep "Usage: tritonserver" >/dev/null

FROM base
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG CREATED=unknown
LABEL org.opencontainers.image.title="gtr-retrieval-triton-cpu" \
      org.opencontainers.image.description="Triton Inference Server (CPU, from nvidia-pytriton) with the Python-backend dependencies of gtr-retrieval's encoder" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/gtr-retrieval/gtr-retrieval" \
      io.gtr-retrieval.variant="cpu"
RUN groupadd --gid 10001 triton \
    && useradd --no-log-init --uid 10001 --gid triton --home-dir /tmp --shell /usr/sbin/nologin triton
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/tritonserver /opt/tritonserver
# The backend stub embeds libpython3.11 (Debian's, matching this interpreter's stdlib) and
# takes sys.prefix from the first python3 on PATH: the virtualenv, so the models import its
# numpy, onnxruntime and tokenizers (services/encoder/serve/triton_server.py explains both).
ENV PATH=/opt/tritonserver/bin:/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu:/opt/venv/lib/python3.11/site-packages/nvidia_pytriton.libs \
    OMP_NUM_THREADS=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
EXPOSE 8000 8001 8002
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python3", "-c", "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/v2/health/ready', timeout=3)"]
ENTRYPOINT ["tritonserver"]
CMD ["--model-repository=/models"]
