"""Queries embedded in this process by the very graph Triton serves them with (CPU).

On a CPU repository a query's encode through Triton is a gRPC call, Triton's queue and
the Python backend's shared-memory hop to its stub, around a graph run of ~2 ms (the int8
query tower, one thread): ~6-7 ms of a quiet search's ~20, and a process wake-up more on
a busy core (docs/performance.md, "One hop fewer"). A gateway that can read the model
repository (the local stack's) opens the version Triton pinned, from the same folder, and
runs its query graph itself; documents (batches, the writers' and the builders') still go
to Triton, which batches them.

It is the same graph, tokenizer and token budget, so the same vectors: checked once when
the encoder is built (probe queries through both; a cosine under :data:`MIN_COSINE` keeps
Triton for queries, logged). Whatever cannot be read (a GPU repository's TensorRT plans,
a version folder another host holds, a digest that differs from the one Triton reports)
keeps Triton too, with the reason logged: the fast path is an optimisation, never a
second source of truth.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from services.encoder.base import Embeddings, Encoder
from services.encoder.build.export import row_cosines
from services.encoder.build.repository import read_config, read_version_description
from services.encoder.profiles import Kind
from services.encoder.runtime.inprocess import InProcessEncoder
from services.encoder.runtime.onnx_embedder import OnnxEmbedder

log = logging.getLogger(__name__)

# The same graph on the same runtime: anything short of equal is a different graph.
MIN_COSINE = 0.999
PROBES = (
    "what is the capital of france",
    "Vitamin D deficiency is associated with increased risk of multiple sclerosis.",
)


def query_workers() -> int:
    """Threads that run query graphs at once: one per CPU this process may use (at most
    4). Each run is one ONNX Runtime thread and releases the GIL, so a burst of queries
    spreads over the cores instead of queueing behind one thread: at 100 hybrid
    searches/s on 2 cores the encode stage's p99 fell from 27-49 ms (one thread) to
    18-19 ms (docs/performance.md, "One hop fewer")."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


class LocalQueries(Encoder):
    """Queries through ``local`` (this process), documents through ``remote`` (Triton).
    Named as the remote is (model, pinned version, digest): callers that key on an
    encoder's identity (the query cache, generations) see the Triton version."""

    def __init__(self, local: Encoder, remote: Encoder) -> None:
        self.local = local
        self.remote = remote
        self.model_name = remote.model_name
        self.dim = remote.dim
        self.max_batch = remote.max_batch

    @property
    def model_version(self) -> int:
        return int(getattr(self.remote, "model_version", 0) or 0)

    @property
    def digest(self) -> str:
        return str(getattr(self.remote, "digest", "") or "")

    async def encode(
        self, texts: Sequence[str], kind: Kind, timeout: float | None = None
    ) -> Embeddings:
        encoder = self.local if kind == "query" else self.remote
        return await encoder.encode(texts, kind, timeout)

    async def close(self) -> None:
        await self.local.close()
        await self.remote.close()


def query_graph(repository: Path, model: str, version: int, digest: str) -> tuple[Path, Path]:
    """(the version folder, its query graph) of ``model`` at ``version`` in a CPU
    repository; ValueError says why this repository's version cannot be run here."""

    model_dir = Path(repository) / model
    folder = model_dir / str(version)
    config_path = model_dir / "config.pbtxt"
    if not config_path.is_file() or not folder.is_dir():
        raise ValueError(f"{folder} (or its config.pbtxt) is not readable here")
    config = read_config(config_path)
    if config.backend != "python":
        raise ValueError(f"{model} is served by Triton's {config.backend or 'platform'} backend")
    described = read_version_description(model_dir, config, version)
    if digest and described.get("digest") and described["digest"] != digest:
        raise ValueError(f"{folder} holds digest {described['digest']}, Triton reports {digest}")
    graph = folder / described.get("onnx_file", "model.onnx")
    if not graph.is_file() or not (folder / "encoder.json").is_file():
        raise ValueError(f"{folder} has no {graph.name} and encoder.json")
    return folder, graph


async def with_local_queries(remote: Encoder, repository: Path, model: str) -> Encoder:
    """``remote`` with its queries embedded here (:class:`LocalQueries`), or ``remote``
    itself when its version cannot be run here or embeds differently (logged)."""

    version = int(getattr(remote, "model_version", 0) or 0)
    digest = str(getattr(remote, "digest", "") or "")
    try:
        folder, graph = query_graph(repository, model, version, digest)
        embedder = await asyncio.to_thread(OnnxEmbedder, folder / "model.onnx", 1, {"query": graph})
    except (ValueError, OSError) as exc:  # --query-repository names what cannot serve
        log.warning("queries of %s@%s go to Triton: %s", model, version, exc)
        return remote
    except Exception as exc:  # an unloadable graph: Triton keeps serving it
        log.warning(
            "queries of %s@%s go to Triton: opening its graph failed: %s", model, version, exc
        )
        return remote
    local = InProcessEncoder(embedder, max_batch=remote.max_batch, workers=query_workers())
    try:
        here = await local.encode(list(PROBES), "query")
        there = await remote.encode(list(PROBES), "query")
        cosine = float(min(row_cosines(here.vectors, there.vectors)))
    except Exception as exc:
        await local.close()
        log.warning(
            "queries of %s@%s go to Triton: the parity probe failed: %s", model, version, exc
        )
        return remote
    if cosine < MIN_COSINE:
        await local.close()
        log.warning(
            "queries of %s@%s go to Triton: this process's vectors differ from Triton's "
            "(min cosine %.5f < %s)",
            model,
            version,
            cosine,
            MIN_COSINE,
        )
        return remote
    log.info(
        "queries of %s@%s are embedded in this process (%s; parity with Triton: cosine %.6f)",
        model,
        version,
        graph,
        cosine,
    )
    return LocalQueries(local, remote)
