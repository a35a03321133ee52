"""Server-side micro-batching: concurrent searches coalesce, answers equal the shard's own."""

from __future__ import annotations

import asyncio
from pathlib import Path

import faiss
import numpy as np
import pytest

from services.common.errors import InvalidArgument
from services.index.core.changes import Upsert
from services.index.core.query import DenseQuery, TopK
from services.index.core.shard import IvfPqShard
from services.index.core.trained import TrainedIndex
from services.index.server.batcher import SearchBatcher
from tests.support.shards import scifact_vectors, shared_test_index

N_BASE = 4683


@pytest.fixture(scope="module")
def vectors(scifact_dir: Path) -> np.ndarray:
    return scifact_vectors(scifact_dir)


@pytest.fixture(scope="module")
def shard(vectors: np.ndarray, tmp_path_factory: pytest.TempPathFactory) -> IvfPqShard:
    trained = TrainedIndex.load(shared_test_index(tmp_path_factory.getbasetemp(), vectors))
    loaded = IvfPqShard(trained)
    loaded.apply([Upsert(str(i), vectors[i], {"parity": str(i % 2)}) for i in range(N_BASE)], "1-0")
    return loaded


@pytest.mark.parametrize("workers", [0, 2], ids=["inline", "pool"])
def test_concurrent_searches_coalesce_and_match(
    shard: IvfPqShard, vectors: np.ndarray, workers: int
) -> None:
    queries = vectors[N_BASE : N_BASE + 64]
    calls: list[int] = []
    original = shard.search_top_k

    def counting(q: np.ndarray, k: int, nprobe: int = 0, filter=(), probes=None, **kw):  # type: ignore[no-untyped-def]
        calls.append(len(q))
        return original(q, k, nprobe, filter, probes, **kw)

    async def run() -> list[TopK]:
        batcher = SearchBatcher(shard, workers=workers)
        try:
            return await asyncio.gather(
                *[
                    batcher.search(DenseQuery(queries[i : i + 1], 5 + i % 3, 16))
                    for i in range(len(queries))
                ]
            )
        finally:
            batcher.close()

    shard.search_top_k = counting  # type: ignore[method-assign,assignment]
    try:
        answers = [top.hits() for top in asyncio.run(run())]
    finally:
        del shard.search_top_k  # type: ignore[method-assign]
    assert sum(calls) == len(queries)
    assert len(calls) < len(queries) / 4  # coalesced: far fewer FAISS calls than queries
    for i, answer in enumerate(answers):
        direct = shard.search(queries[i : i + 1], 5 + i % 3, 16)
        assert [d for d, _ in answer[0]] == [d for d, _ in direct[0]]
        assert len(answer[0]) == 5 + i % 3  # each caller gets its own k


@pytest.mark.parametrize("workers", [0, 2], ids=["inline", "pool"])
def test_filtered_search_and_errors(shard: IvfPqShard, vectors: np.ndarray, workers: int) -> None:
    async def run() -> None:
        batcher = SearchBatcher(shard, workers=workers)
        try:
            parity = (("parity", ("1",)),)
            top = await batcher.search(DenseQuery(vectors[N_BASE : N_BASE + 2], 10, 16, parity))
            hits = top.hits()
            assert all(len(row) == 10 for row in hits)
            assert all(int(d) % 2 == 1 for row in hits for d, _ in row)
            with pytest.raises(InvalidArgument):
                await batcher.search(DenseQuery(vectors[N_BASE : N_BASE + 1, :10], 10, 16))
        finally:
            batcher.close()

    asyncio.run(run())


def test_negative_workers_rejected(shard: IvfPqShard) -> None:
    with pytest.raises(ValueError, match="workers"):
        SearchBatcher(shard, workers=-1)


def test_pool_workers_run_faiss_with_the_configured_threads(
    shard: IvfPqShard, vectors: np.ndarray
) -> None:
    # OpenMP's thread count is per thread: without the pool's initializer a worker sees
    # the process default (its core count), whatever the main thread set.
    seen: list[int] = []
    original = shard.search_top_k

    def recording(q: np.ndarray, k: int, nprobe: int = 0, filter=(), probes=None, **kw):  # type: ignore[no-untyped-def]
        seen.append(faiss.omp_get_max_threads())
        return original(q, k, nprobe, filter, probes, **kw)

    async def run() -> None:
        batcher = SearchBatcher(shard, workers=2, omp_threads=3)
        try:
            await asyncio.gather(
                *[batcher.search(DenseQuery(vectors[i : i + 1], 5, 16)) for i in range(8)]
            )
        finally:
            batcher.close()

    shard.search_top_k = recording  # type: ignore[method-assign,assignment]
    try:
        asyncio.run(run())
    finally:
        del shard.search_top_k  # type: ignore[method-assign]
    assert seen and set(seen) == {3}
