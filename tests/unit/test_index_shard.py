"""The in-memory IVF-PQ shard: congruence with exact search, changes, filters, validation."""

from __future__ import annotations

from pathlib import Path

import faiss
import numpy as np
import pytest

from services.common.errors import InvalidArgument
from services.index.core.changes import Delete, Upsert
from services.index.core.ids import faiss_id
from services.index.core.shard import IvfPqShard
from services.index.core.snapshots import list_snapshots, load_newest, write_snapshot
from services.index.core.trained import TrainedIndex
from tests.support.shards import trained, vectors

N_BASE = 4683  # the rest of the 5,183 SciFact documents are held-out queries
__all__ = ["trained", "vectors"]  # the module-scoped fixtures, shared


@pytest.fixture(scope="module")
def loaded(trained: TrainedIndex, vectors: np.ndarray) -> IvfPqShard:
    shard = IvfPqShard(trained)
    shard.apply([Upsert(str(i), vectors[i]) for i in range(N_BASE)], "1-0")
    return shard


def recall_at_10(found: list[list[tuple[str, float]]], exact: np.ndarray) -> float:
    return float(
        np.mean(
            [
                len({int(d) for d, _ in hits} & set(truth.tolist())) / 10
                for hits, truth in zip(found, exact, strict=True)
            ]
        )
    )


@pytest.mark.slow
def test_recall_at_10_against_exact_inner_product(loaded: IvfPqShard, vectors: np.ndarray) -> None:
    queries = vectors[N_BASE:]
    flat = faiss.IndexFlatIP(vectors.shape[1])
    flat.add(vectors[:N_BASE])
    _, exact = flat.search(queries, 10)
    found = [
        h for i in range(0, len(queries), 256) for h in loaded.search(queries[i : i + 256], 10, 32)
    ]
    assert recall_at_10(found, exact) >= 0.95
    # scores come from the SQ8 refine: close to the exact inner products, best first
    top = loaded.search(queries[:5], 10, 32)
    for row, hits in zip(queries[:5], top, strict=True):
        scores = [s for _, s in hits]
        assert scores == sorted(scores, reverse=True)
        exact_scores = vectors[[int(d) for d, _ in hits]] @ row
        assert np.allclose(scores, exact_scores, atol=0.02)


@pytest.mark.slow
def test_upsert_delete_upsert_same_id(trained: TrainedIndex, vectors: np.ndarray) -> None:
    shard = IvfPqShard(trained)
    a, b = vectors[0], vectors[1]
    shard.apply([Upsert("x", a), Upsert("y", b)], "1-0")
    assert shard.search(a[None], 1)[0][0][0] == "x"
    shard.apply([Delete("x")], "2-0")
    assert len(shard) == 1 and not shard.contains("x")
    assert all(d != "x" for d, _ in shard.search(a[None], 10)[0])
    shard.apply([Upsert("x", b)], "3-0")  # back, with another vector
    assert len(shard) == 2
    assert {d for d, _ in shard.search(b[None], 2)[0]} == {"x", "y"}
    # upsert of an existing id replaces it (remove + add): no duplicate
    shard.apply([Upsert("x", a)], "4-0")
    assert len(shard) == 2 and shard.search(a[None], 1)[0][0][0] == "x"
    # within one batch the last change of an id wins, in log order
    shard.apply([Upsert("z", a), Delete("z"), Upsert("w", b), Delete("w"), Upsert("w", a)], "5-0")
    assert not shard.contains("z") and shard.contains("w")
    assert shard.applied == "5-0" and shard.stats().deleted == 1


def test_a_63_bit_id_collision_keeps_the_newer_document(
    trained: TrainedIndex,
    vectors: np.ndarray,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    import services.index.core.shard as shard_module

    def colliding(doc_id: str) -> int:  # "a…" ids all share one FAISS id
        return 7 if doc_id.startswith("a") else faiss_id(doc_id)

    monkeypatch.setattr(shard_module, "faiss_id", colliding)
    shard = IvfPqShard(trained)
    batch = [Upsert("a1", vectors[0]), Upsert("a2", vectors[1]), Upsert("b", vectors[2])]
    shard.apply(batch, "1-0")
    assert len(shard) == 2 and sorted(shard.doc_ids()) == ["a2", "b"]
    assert shard.search(vectors[1][None], 1)[0][0][0] == "a2"
    shard.apply([Upsert("a3", vectors[3])], "2-0")  # across batches: replaces a2
    assert len(shard) == 2 and sorted(shard.doc_ids()) == ["a3", "b"]
    assert shard.search(vectors[3][None], 1)[0][0][0] == "a3"
    assert sum("63-bit id collision" in r.getMessage() for r in caplog.records) == 2


def test_refine_by_blocks_gives_the_same_answers(
    loaded: IvfPqShard, vectors: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    import services.index.core.scan as scan_module

    queries = vectors[N_BASE : N_BASE + 60]
    whole = loaded.search_top_k(queries, 10, 8)
    monkeypatch.setattr(scan_module, "REFINE_BLOCK", 3 * 40 + 1)  # 3 rows of 40 per block
    blocks = loaded.search_top_k(queries, 10, 8)
    assert blocks.ids == whole.ids
    np.testing.assert_array_equal(blocks.scores, whole.scores)


def test_filters_select_by_metadata(trained: TrainedIndex, vectors: np.ndarray) -> None:
    shard = IvfPqShard(trained)
    shard.apply(
        [
            Upsert(str(i), vectors[i], {"year": str(2000 + i % 3), "kind": "a" if i % 2 else "b"})
            for i in range(300)
        ],
        "1-0",
    )
    hits = shard.search(vectors[:4], 20, 32, [("year", ["2001"])])
    assert all(int(d) % 3 == 1 for row in hits for d, _ in row) and all(row for row in hits)
    hits = shard.search(vectors[:4], 20, 32, [("year", ["2001", "2002"]), ("kind", ["a"])])
    assert all(int(d) % 3 != 0 and int(d) % 2 == 1 for row in hits for d, _ in row)
    assert shard.search(vectors[:2], 5, 0, [("year", ["1999"])]) == [[], []]
    # a re-upsert with other tags moves the document between posting lists
    shard.apply([Upsert("1", vectors[1], {"year": "1999"})], "2-0")
    assert [d for d, _ in shard.search(vectors[1:2], 5, 0, [("year", ["1999"])])[0]] == ["1"]


@pytest.mark.parametrize(
    ("queries", "k", "nprobe", "message"),
    [
        (np.ones((1, 100), np.float32), 10, 0, "dimension"),
        (np.full((1, 384), np.nan, np.float32), 10, 0, "NaN"),
        (np.full((1, 384), np.inf, np.float32), 10, 0, "NaN"),
        (np.ones((1, 384), np.float32), 0, 0, "k"),
        (np.ones((1, 384), np.float32), 1001, 0, "k"),
        (np.ones((1, 384), np.float32), 10, 100_000, "nprobe"),
        (np.ones((257, 384), np.float32), 10, 0, "1..256"),
    ],
)
def test_invalid_searches_are_rejected(
    loaded: IvfPqShard, queries: np.ndarray, k: int, nprobe: int, message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        loaded.search(queries, k, nprobe)


def test_bad_vectors_in_a_change_batch_change_nothing(
    trained: TrainedIndex, vectors: np.ndarray
) -> None:
    shard = IvfPqShard(trained)
    shard.apply([Upsert("a", vectors[0])], "1-0")
    with pytest.raises(InvalidArgument):
        shard.apply([Upsert("b", vectors[1]), Upsert("c", np.full(384, np.nan, np.float32))], "2-0")
    with pytest.raises(InvalidArgument):
        shard.check_vector(np.ones(383, np.float32))
    assert len(shard) == 1 and shard.applied == "1-0"


def test_stats_report_size_and_quantizer_health(loaded: IvfPqShard) -> None:
    stats = loaded.stats()
    assert stats.vectors == N_BASE
    assert stats.bytes_per_vector == 96 + 8 + 384
    # the memory adds to the codes the centroids, the free capacity and the id maps
    codes = N_BASE * stats.bytes_per_vector
    assert codes + 384 * 4 * loaded.manifest.nlist + N_BASE * 16 < stats.memory_bytes < 3 * codes
    assert 0.5 < stats.pq_error_ratio < 1.5  # same distribution as the training sample
    assert 1.0 <= stats.list_imbalance < 3.0


def test_snapshot_round_trip_and_corrupt_snapshot_falls_back(
    trained: TrainedIndex, vectors: np.ndarray, tmp_path: Path
) -> None:
    shard = IvfPqShard(trained)
    shard.apply([Upsert(str(i), vectors[i], {"t": str(i % 2)}) for i in range(500)], "5-0")
    first = write_snapshot(shard, tmp_path, keep=2)
    shard.apply([Delete("0"), Upsert("new", vectors[600])], "9-1")
    newest = write_snapshot(shard, tmp_path, keep=2)
    assert [s.position for s in list_snapshots(tmp_path)] == ["9-1", "5-0"]

    restored, used = load_newest(tmp_path, trained)
    assert used == newest and restored.applied == "9-1" and len(restored) == 500
    q = vectors[100:110]
    assert restored.search(q, 10, 16, [("t", ["1"])]) == shard.search(q, 10, 16, [("t", ["1"])])

    data = bytearray(newest.path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: the checksum catches it
    newest.path.write_bytes(bytes(data))
    restored, used = load_newest(tmp_path, trained)
    assert used == first and restored.applied == "5-0" and restored.contains("0")

    first.path.write_bytes(first.path.read_bytes()[:1000])  # truncated too: start empty
    restored, used = load_newest(tmp_path, trained)
    assert used is None and len(restored) == 0

    for i in range(3):
        write_snapshot(shard, tmp_path / "keep", keep=2)
        shard.apply([Upsert(f"k{i}", vectors[i])], f"{10 + i}-0")
    assert len(list_snapshots(tmp_path / "keep")) == 2


def test_a_snapshot_is_readable_by_its_owner_only(
    trained: TrainedIndex, vectors: np.ndarray, tmp_path: Path
) -> None:
    """Issue #33 point 3: a snapshot holds every vector and text of its shard; under a
    umask of 022 (the usual one) it was written 0644 in a 0755 folder, readable by any
    local user. Now its folder is 0700 and its files 0600 whatever the umask."""
    import os
    import stat

    shard = IvfPqShard(trained)
    shard.apply([Upsert(str(i), vectors[i]) for i in range(50)], "3-0")
    old = os.umask(0o022)
    try:
        snap = write_snapshot(shard, tmp_path / "snapshots" / "shard-0", keep=2)
    finally:
        os.umask(old)
    folder = snap.path.parent
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    files = sorted(folder.iterdir())
    assert {p.suffix for p in files} == {".npz", ".json"}, files
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
