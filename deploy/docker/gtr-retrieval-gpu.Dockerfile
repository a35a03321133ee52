# syntax=docker/dockerfile:1
# gtr-retrieval (GPU): the CPU image's roles with CUDA torch (the reranker), faiss-gpu (the
# shards' GPU copy of the index), onnxruntime-gpu and TensorRT 10.7.0 (the release inside
# the chart's Triton image, for `gtr-retrieval encoder build-plan`): pyproject.toml's `gpu`
# extra. CUDA's user-space libraries come as NVIDIA's wheels with torch; the node provides
# the driver. Every package uses the CUDA major of the chart's Triton image (24.12-py3:
# CUDA 12.6; CUDA_MAJOR below), so one driver serves both: R560+, or R535/R545 on data
# center GPUs (docs/deploy.md, checklist row 1); check_cuda.py fails the build otherwise.
# Built by `scripts/build_images.sh --gpu` (needs PyPI and the PyTorch cu126 index: the
# wheelhouse holds only the project's own wheel); linted and parsed by
# tests/unit/test_images.py, the pins' CUDA checked by tests/unit/test_images_cuda.py.

ARG BASE_IMAGE=docker.io/library/debian:bookworm-20250520-slim

FROM ${BASE_IMAGE} AS base
# hadolint ignore=DL3008
RUN dpkg-query -W python3.11 libpython3.11 ca-certificates >/dev/null 2>&1 \
    || { apt-get update \
         && apt-get install -y --no-install-recommends python3.11 libpython3.11 ca-certificates \
         && rm -rf /var/lib/apt/lists/*; }

FROM base AS build
# The CUDA major of the Triton image (tensorrt_build.py TRITON_CUDA). PyPI's torch 2.13.0
# is the CUDA 13 build (cuda-toolkit 13.0.3, nvidia-cudnn-cu13): the CUDA 12.6 one,
# 2.13.0+cu126, comes from PyTorch's cu126 index; the project's wheel from the wheelhouse.
ARG CUDA_MAJOR=12
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu126
COPY deploy/docker/check_cuda.py /usr/local/lib/gtr/check_cuda.py
RUN --mount=type=bind,source=build/wheels/gpu,target=/wheels \
    python3.11 -m venv --without-pip /opt/venv \
    && PIP_WHEEL="$(ls /wheels/pip-*.whl)" \
    && /opt/venv/bin/python "$PIP_WHEEL/pip" install --find-links=/wheels --no-cache-dir \
         --extra-index-url "${TORCH_INDEX}" \
         --disable-pip-version-check --no-warn-script-location "torch==2.13.0+cu126" "gtr-retrieval[gpu]" \
    && /opt/venv/bin/python /usr/local/lib/gtr/check_cuda.py --major "${CUDA_MAJOR}" --torch

FROM base
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG CREATED=unknown
LABEL org.opencontainers.image.title="gtr-retrieval-gpu" \
      org.opencontainers.image.description="Retrieval service (GPU): rerank on CUDA torch, shards on faiss-gpu, TensorRT plan builder" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/gtr-retrieval/gtr-retrieval" \
      io.gtr-retrieval.variant="gpu"
RUN groupadd --gid 10001 gtr \
    && useradd --no-log-init --uid 10001 --gid gtr --home-dir /var/lib/gtr --shell /usr/sbin/nologin gtr \
    && install -d -m 0700 -o gtr -g gtr /var/lib/gtr
COPY --from=build /opt/venv /opt/venv
COPY deploy/docker/healthcheck.py /usr/local/lib/gtr/healthcheck.py
ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/var/lib/gtr \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
WORKDIR /var/lib/gtr
USER 10001:10001
# gRPC health of the role that runs: its --health-port when set, else its serving port
# (TLS when it serves TLS); deploy/docker/healthcheck.py.
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["/opt/venv/bin/python", "/usr/local/lib/gtr/healthcheck.py"]
ENTRYPOINT ["gtr-retrieval"]
CMD ["--help"]
