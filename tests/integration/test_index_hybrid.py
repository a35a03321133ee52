"""Sparse and hybrid searches through the router to real shard processes (real Redis):
each shard answers its dense and BM25 lists of one batch, the router merges each;
read-your-writes, filters, coalescing, a replica without text index, bad input."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from services.common.domain import IndexResult
from services.common.errors import InvalidArgument
from services.common.limits import LIMITS
from services.index.client.router import ShardRouter
from services.index.client.writer import ChangeLogWriter, DocRecord
from services.index.core.query import Consistency, IndexQuery
from tests.support.shards import (
    ShardCluster,
    run_shards,
    scifact_vectors,
    shared_test_index,
    start_shard,
)

N_DOCS = 1200
SHARDS = 2
REDIS_DB = 6  # this module's own database (tests/conftest.py module_redis)


@pytest.fixture(scope="module")
def vectors(scifact_dir: Path) -> np.ndarray:
    return scifact_vectors(scifact_dir)


@pytest.fixture(scope="module")
def docs(scifact_dir: Path) -> list[dict[str, str]]:
    with open(scifact_dir / "corpus.jsonl", encoding="utf-8") as fh:
        return [json.loads(line) for _, line in zip(range(N_DOCS), fh, strict=False)]


@pytest.fixture(scope="module")
def cluster(
    vectors: np.ndarray,
    docs: list[dict[str, str]],
    module_redis: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ShardCluster]:
    index_dir = shared_test_index(tmp_path_factory.getbasetemp(), vectors)

    async def load() -> None:
        writer = ChangeLogWriter.connect(module_redis, SHARDS, dim=384)
        try:
            for i in range(0, N_DOCS, 300):
                await writer.upsert(
                    [
                        DocRecord(d["_id"], vectors[j], d["title"], d["text"], {"par": str(j % 2)})
                        for j, d in enumerate(docs[i : i + 300], start=i)
                    ]
                )
        finally:
            await writer.close()

    asyncio.run(load())
    with run_shards(
        index_dir, module_redis, tmp_path_factory.mktemp("cluster"), shards=SHARDS
    ) as running:
        yield running


def search(addresses: list[list[str]], query: IndexQuery) -> IndexResult:
    async def run() -> IndexResult:
        router = ShardRouter(addresses)
        try:
            return await router.search(query, timeout=30)
        finally:
            await router.close()

    return asyncio.run(run())


def ids(rows: list[Any] | None) -> list[list[str]]:
    assert rows is not None
    return [[h.id for h in row] for row in rows]


def test_hybrid_answers_both_lists_each_merged_over_the_shards(
    cluster: ShardCluster, vectors: np.ndarray, docs: list[dict[str, str]]
) -> None:
    # each query is a document's title: BM25 puts that document first
    picked = [3, 250, 777, 1100]
    texts = tuple(docs[i]["title"] for i in picked)
    hybrid = search(cluster.addresses, IndexQuery(vectors[picked], 10, texts=texts, sparse_k=20))
    dense = search(cluster.addresses, IndexQuery(vectors[picked], 10))
    assert ids(hybrid.hits) == ids(dense.hits)  # the dense list is the dense search's
    sparse = ids(hybrid.sparse)
    assert [row[0] for row in sparse] == [docs[i]["_id"] for i in picked]
    assert all(len(row) == 20 for row in sparse)
    assert hybrid.sparse_missing_shards == [] and hybrid.missing_shards == []
    assert hybrid.sparse is not None
    for row in hybrid.sparse:  # merged over both shards, best BM25 score first
        assert [h.score for h in row] == sorted((h.score for h in row), reverse=True)
    assert {h.shard for row in hybrid.sparse for h in row} == {0, 1}
    only = search(cluster.addresses, IndexQuery(None, 0, texts=texts, sparse_k=20))
    assert only.hits == [[], [], [], []] and ids(only.sparse) == sparse


def test_concurrent_single_sparse_searches_coalesce_to_the_same_answers(
    cluster: ShardCluster, vectors: np.ndarray, docs: list[dict[str, str]]
) -> None:
    texts = tuple(docs[i]["title"] for i in range(0, 600, 20))
    batch = search(cluster.addresses, IndexQuery(vectors[0:600:20], 5, texts=texts, sparse_k=5))

    async def run() -> list[IndexResult]:
        router = ShardRouter(cluster.addresses)
        try:
            return await asyncio.gather(
                *[
                    router.search(
                        IndexQuery(vectors[i : i + 1], 5, texts=(t,), sparse_k=5), timeout=30
                    )
                    for i, t in zip(range(0, 600, 20), texts, strict=True)
                ]
            )
        finally:
            await router.close()

    singles = asyncio.run(run())
    assert [ids(r.sparse)[0] for r in singles] == ids(batch.sparse)
    assert [ids(r.hits)[0] for r in singles] == ids(batch.hits)


def test_sparse_reads_its_writes_and_never_returns_a_deleted_document(
    cluster: ShardCluster, vectors: np.ndarray, module_redis: str
) -> None:
    async def run() -> None:
        writer = ChangeLogWriter.connect(module_redis, SHARDS, dim=384)
        router = ShardRouter(cluster.addresses)
        try:
            token = await writer.upsert(
                [DocRecord("okapi", vectors[N_DOCS], "Okapi", "an okapi zebrafish", {"par": "9"})]
            )
            for consistency in (Consistency.SESSION, Consistency.STRONG):
                query = IndexQuery(
                    None,
                    0,
                    texts=("okapi",),
                    sparse_k=5,
                    consistency=consistency,
                    write_token=token,
                )
                found = await router.search(query, timeout=30)
                assert ids(found.sparse) == [["okapi"]]
            query = IndexQuery(None, 0, texts=("okapi",), sparse_k=5, filter=[("par", ["1"])])
            filtered = await router.search(query, timeout=30)
            assert ids(filtered.sparse) == [[]]
            token, deleted, _ = await writer.delete(["okapi"])
            assert deleted == ["okapi"]
            query = IndexQuery(
                vectors[N_DOCS : N_DOCS + 1],
                5,
                texts=("okapi zebrafish",),
                sparse_k=5,
                consistency=Consistency.SESSION,
                write_token=token,
            )
            gone = await router.search(query, timeout=30)
            assert "okapi" not in ids(gone.sparse)[0] and "okapi" not in ids(gone.hits)[0]
        finally:
            await router.close()
            await writer.close()

    asyncio.run(run())


def test_a_replica_without_text_index_answers_dense_and_says_so(
    cluster: ShardCluster,
    vectors: np.ndarray,
    docs: list[dict[str, str]],
    module_redis: str,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GTR_SHARD_TEXT_INDEX", "false")  # the child's --no-text-index
    plain = start_shard(
        index_dir=shared_test_index(tmp_path_factory.getbasetemp(), vectors),
        redis_url=module_redis,
        shard=1,
        shards=SHARDS,
        work_dir=tmp_path,
        replica="shard-1-dense-only",
    )
    try:
        addresses = [cluster.addresses[0], [plain.address]]
        texts = tuple(docs[i]["title"] for i in (1, 2))
        result = search(addresses, IndexQuery(vectors[[1, 2]], 10, texts=texts, sparse_k=10))
        assert result.missing_shards == [] and result.sparse_missing_shards == [1]
        assert result.sparse is not None
        assert {h.shard for row in result.sparse for h in row} == {0}
        assert {h.shard for row in result.hits for h in row} == {0, 1}
    finally:
        plain.stop()


def test_bad_sparse_searches_are_invalid_arguments(
    cluster: ShardCluster, vectors: np.ndarray
) -> None:
    many = " ".join(f"w{i}" for i in range(LIMITS.max_query_terms + 1))
    cases: list[tuple[dict[str, Any], str]] = [
        ({"texts": ("a",), "sparse_k": 0}, "sparse_k"),
        ({"texts": ("a", "b"), "sparse_k": 5}, "one query text per query vector"),
        ({"texts": (many,), "sparse_k": 5}, "distinct terms"),
    ]
    for kw, message in cases:
        with pytest.raises(InvalidArgument, match=message):
            search(cluster.addresses, IndexQuery(vectors[:1], 5, **kw))
    # a text of no indexable term answers an empty sparse list, not an error
    empty = search(cluster.addresses, IndexQuery(None, 0, texts=("?! ...",), sparse_k=5))
    assert ids(empty.sparse) == [[]]
