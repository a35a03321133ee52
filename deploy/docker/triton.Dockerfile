# syntax=docker/dockerfile:1
# Triton Inference Server for GPU nodes: NVIDIA's release image plus exactly what our
# Python-backend models import (services/encoder/build/triton_models/*.py on the CPU path and
# the GPU repository's `tokenizer` model: numpy, onnxruntime-gpu, tokenizers; the model
# repository carries textcodec.py and model_errors.py itself). The TensorRT inside the base
# (24.12: TensorRT 10.7.0) is the one `gtr-retrieval encoder build-plan` must build the plan
# with (services/encoder/build/tensorrt_build.py TRITON_TENSORRT); the chart's plan init container
# refuses a plan built for another GPU or TensorRT release.
# Built by `scripts/build_images.sh --gpu` (needs nvcr.io and PyPI); linted and parsed by
# tests/unit/test_images.py.

ARG TRITON_IMAGE=nvcr.io/nvidia/tritonserver:24.12-py3

FROM ${TRITON_IMAGE} AS build
# No virtualenv: `python3 -m venv` needs ensurepip (Ubuntu's python3-venv), which NVIDIA's
# image need not have. The packages (pyproject.toml's pins) go to a directory of their own
# with the image's pip (`--target`: also past a PEP 668 externally-managed marker), and a
# .pth file in the image Python's site-packages puts it first on sys.path: the Python
# backend stub runs that Python and reads its .pth files, but ignores PYTHONPATH
# (docs/encoder.md). /staging mirrors / for the final stage.
# onnxruntime-gpu 1.26.0: the last CUDA 12 build on PyPI (1.27.0 on are CUDA 13); the
# base's CUDA is 12.6, checked by check_cuda.py (CUDA_MAJOR, as in the application image).
ARG CUDA_MAJOR=12
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
COPY deploy/docker/check_cuda.py /opt/gtr/check_cuda.py
RUN python3 -m pip install --no-cache-dir --disable-pip-version-check --no-compile \
        --target /opt/gtr/site-packages \
        numpy==1.26.4 onnxruntime-gpu==1.26.0 tokenizers==0.23.3 \
    && python3 /opt/gtr/check_cuda.py --major "${CUDA_MAJOR}" --path /opt/gtr/site-packages \
    && site_dir="$(python3 -c 'import site; print(site.getsitepackages()[0])')" \
    && mkdir -p "/staging${site_dir}" \
    && echo "import sys; sys.path.insert(0, '/opt/gtr/site-packages')" \
        > "/staging${site_dir}/gtr-retrieval.pth"

FROM ${TRITON_IMAGE}
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG CREATED=unknown
LABEL org.opencontainers.image.title="gtr-retrieval-triton" \
      org.opencontainers.image.description="NVIDIA Triton 24.12 with the Python-backend dependencies of gtr-retrieval's encoder" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/gtr-retrieval/gtr-retrieval" \
      io.gtr-retrieval.variant="gpu"
COPY --from=build /opt/gtr/site-packages /opt/gtr/site-packages
COPY --from=build /staging/ /
# NVIDIA's image has the unprivileged user triton-server (uid 1000); the chart runs the pod
# as 10001, which needs no entry in /etc/passwd.
USER 1000:1000
EXPOSE 8000 8001 8002
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python3", "-c", "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/v2/health/ready', timeout=3)"]
ENTRYPOINT ["tritonserver"]
CMD ["--model-repository=/models"]
