# syntax=docker/dockerfile:1
# gtr-retrieval (CPU): the gateway, the index shards, the CELI reranker and the CLI in one
# image; the command picks the role:
#   gtr-retrieval gateway serve | index serve | rerank serve | encoder export | index train ...
# Built by scripts/build_images.sh (docker, or buildah where there is no Docker daemon) from
# a wheelhouse it fills on the host (build/wheels/cpu: the project's wheel, the SDK's, which
# holds the generated wire contract `retrieval`, torch 2.13.0+cpu, faiss-cpu, onnxruntime and
# the other pins of pyproject.toml), so the build itself needs no network. Image names and
# tags: deploy/images.env.

# Debian bookworm with Python 3.11. The default is the registry image of the Debian snapshot
# the build script's own base uses (20250520); without a registry the build script makes the
# same base with mmdebstrap from Debian's packages and passes it as BASE_IMAGE.
ARG BASE_IMAGE=docker.io/library/debian:bookworm-20250520-slim

FROM ${BASE_IMAGE} AS base
# A base from the build script already holds these packages; a registry image gets them here.
# hadolint ignore=DL3008
RUN dpkg-query -W python3.11 libpython3.11 ca-certificates >/dev/null 2>&1 \
    || { apt-get update \
         && apt-get install -y --no-install-recommends python3.11 libpython3.11 ca-certificates \
         && rm -rf /var/lib/apt/lists/*; }

FROM base AS build
# The virtualenv is made without pip; pip runs from its wheel in the wheelhouse and installs
# only from the wheelhouse (--no-index), so the final stage has no pip and no compiler.
RUN --mount=type=bind,source=build/wheels/cpu,target=/wheels \
    python3.11 -m venv --without-pip /opt/venv \
    && PIP_WHEEL="$(ls /wheels/pip-*.whl)" \
    && /opt/venv/bin/python "$PIP_WHEEL/pip" install --no-index --find-links=/wheels \
         --no-cache-dir --no-compile --disable-pip-version-check --no-warn-script-location \
         "gtr-retrieval[cpu]" \
    && /opt/venv/bin/python -m compileall -q -j 0 /opt/venv/lib/python3.11/site-packages/services \
       /opt/venv/lib/python3.11/site-packages/retrieval \
       /opt/venv/lib/python3.11/site-packages/gtr_client >/dev/null \
    && if /opt/venv/bin/python -c "import torch, sys; sys.exit(torch.version.cuda is None)"; then \
         echo "a CUDA torch reached the CPU image" >&2; exit 1; fi

FROM base
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG CREATED=unknown
LABEL org.opencontainers.image.title="gtr-retrieval" \
      org.opencontainers.image.description="Retrieval service (CPU): gateway, IVF-PQ index shard, CELI rerank, CLI" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/gtr-retrieval/gtr-retrieval" \
      io.gtr-retrieval.variant="cpu"
# The chart's podSecurityContext runs every pod as 10001:10001.
RUN groupadd --gid 10001 gtr \
    && useradd --no-log-init --uid 10001 --gid gtr --home-dir /var/lib/gtr --shell /usr/sbin/nologin gtr \
    && install -d -m 0700 -o gtr -g gtr /var/lib/gtr
COPY --from=build /opt/venv /opt/venv
COPY deploy/docker/healthcheck.py /usr/local/lib/gtr/healthcheck.py
ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/var/lib/gtr
WORKDIR /var/lib/gtr
USER 10001:10001
# gRPC health of the role that runs (deploy/docker/healthcheck.py): its plaintext
# --health-port / GTR_<SERVICE>_HEALTH_PORT when set (the probe port under TLS), else its
# serving port, over TLS with the process's own certificate when it serves TLS.
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["/opt/venv/bin/python", "/usr/local/lib/gtr/healthcheck.py"]
ENTRYPOINT ["gtr-retrieval"]
CMD ["--help"]
