"""A search's first stage: dense (the query embedding), sparse (BM25 in the shards' text
indexes; the query is not encoded) or hybrid (both lists from one fan-out, each merged over
the shards by the router, then fused here by :mod:`services.common.fusion`). The queries of
a batch that share their search parameters go to the index in one call.

No grpc here (see :mod:`services.gateway.pipeline`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from services.common.deadline import Deadline
from services.common.domain import IndexResult
from services.common.fusion import Fusion, Mode, RetrievalDefaults, fuse_hits
from services.gateway.domain import Hit, SearchQuery
from services.gateway.generation_parts import Bundle
from services.gateway.ports import IndexQuery
from services.telemetry import tracing


@dataclass(frozen=True)
class Stage:
    """How one query's first stage runs: its mode, each list's depth, the fusion."""

    mode: Mode
    dense_k: int  # 0: no dense list
    sparse_k: int  # 0: no sparse list
    fusion: Fusion | None  # hybrid only


@dataclass
class Found:
    """One query's first-stage hits and the shards missing from them."""

    hits: list[Hit]
    missing: list[int]
    sparse_missing: list[int] = field(default_factory=list)


def first_stage(stage: Stage, result: IndexResult, row: int, k: int) -> list[Hit]:
    """The ``k`` hits of one query row: the dense list, the sparse one (ranked), or both
    fused (each hit's ranks kept; its first-stage score the fused one)."""
    dense = result.hits[row] if stage.dense_k else []
    sparse = result.sparse[row] if stage.sparse_k and result.sparse is not None else []
    if stage.mode is Mode.DENSE:
        return dense[:k]
    if stage.mode is Mode.SPARSE:
        for rank, hit in enumerate(sparse, 1):
            hit.sparse_rank = rank
        return sparse[:k]
    assert stage.fusion is not None
    return fuse_hits(dense, sparse, stage.fusion, k)


def group_key(q: SearchQuery, fetch_k: int, stage: Stage) -> tuple[object, ...]:
    """What queries share to go to the index in one call."""
    return (
        fetch_k,
        stage.dense_k,
        stage.sparse_k,
        q.nprobe,
        q.filter,
        q.consistency,
        tuple(sorted(q.write_token.items())),
        q.require_complete,
    )


def plan_stage(q: SearchQuery, fetch_k: int, retrieval: RetrievalDefaults) -> Stage:
    """How ``q``'s first stage runs: its mode (else the gateway's), each list's depth (a
    hybrid list at least the candidates asked for) and its fusion."""
    mode = q.mode or retrieval.mode
    if mode is Mode.DENSE:
        return Stage(mode, fetch_k, 0, None)
    if mode is Mode.SPARSE:
        return Stage(mode, 0, fetch_k, None)
    depth = max(fetch_k, q.candidates or retrieval.candidates)
    return Stage(mode, depth, depth, q.fusion or retrieval.fusion)


async def search_index(
    parts: Bundle,
    queries: Sequence[SearchQuery],
    fetch_ks: Sequence[int],
    stages: Sequence[Stage],
    vectors: np.ndarray,
    deadline: Deadline,
) -> list[Found]:
    """One index call per group of queries that share their search parameters."""
    groups: dict[tuple[object, ...], list[int]] = {}
    for i, (q, fk, stage) in enumerate(zip(queries, fetch_ks, stages, strict=True)):
        groups.setdefault(group_key(q, fk, stage), []).append(i)

    out: list[Found] = [Found([], [])] * len(queries)

    async def run(rows: list[int]) -> None:
        first, stage = queries[rows[0]], stages[rows[0]]
        query = IndexQuery(
            vectors[rows] if stage.dense_k else None,
            stage.dense_k,
            nprobe=first.nprobe,
            filter=first.filter,
            consistency=first.consistency,
            write_token=first.write_token,
            require_complete=first.require_complete,
            texts=tuple(queries[i].text for i in rows) if stage.sparse_k else (),
            sparse_k=stage.sparse_k,
        )
        result = await parts.index.search(query, deadline.remaining())
        fusion = stage.fusion
        with tracing.span("fusion") if fusion is not None else tracing.NOOP as span:
            if span and fusion is not None:
                span.set_attributes({"gtr.fusion": fusion.method.value, "gtr.queries": len(rows)})
            for j, row in enumerate(rows):
                out[row] = Found(
                    first_stage(stages[row], result, j, fetch_ks[row]),
                    list(result.missing_shards),
                    list(result.sparse_missing_shards) if stage.sparse_k else [],
                )

    await asyncio.gather(*[run(rows) for rows in groups.values()])
    return out
