"""Stable ids and shards, log positions and write tokens."""

from __future__ import annotations

import pytest

from services.common import positions
from services.common.errors import InvalidArgument
from services.index.core.ids import faiss_id, shard_of


def test_faiss_id_is_stable_63_bit_and_distinct() -> None:
    ids = [faiss_id(f"doc-{i}") for i in range(10_000)]
    assert all(0 <= i < 2**63 for i in ids)
    assert len(set(ids)) == len(ids)
    # Pinned to literal values: every process and every version must agree on a
    # document's FAISS id and shard (snapshots and stored logs depend on them); a change
    # of hash, key, byte order or mask fails here.
    assert faiss_id("4983") == 5638971388828818207
    assert faiss_id("doc-1") == 726955062523864086
    assert faiss_id("café/ü 7") == 5302778974610240901  # UTF-8, not another encoding
    assert [shard_of("4983", n) for n in (2, 7, 64)] == [1, 4, 55]
    assert [shard_of("doc-1", n) for n in (2, 7, 64)] == [0, 4, 44]
    assert [shard_of("café/ü 7", n) for n in (2, 7, 64)] == [0, 2, 60]


def test_shard_of_spreads_and_is_independent_of_faiss_id() -> None:
    counts = [0] * 4
    for i in range(4000):
        counts[shard_of(f"doc-{i}", 4)] += 1
    assert min(counts) > 800
    with pytest.raises(ValueError):
        shard_of("x", 0)


def test_positions_compare_as_ms_then_seq() -> None:
    assert positions.compare("10-2", "9-99") == 1
    assert positions.compare("10-2", "10-10") == -1
    assert positions.compare("10-2", "10-2") == 0
    assert positions.at_least("10-0", "9-99")
    assert positions.newest("1-5", "2-0", "1-9") == "2-0"
    assert positions.oldest("1-5", "2-0", "1-9") == "1-5"
    assert positions.ms_of("1700000000000-3") == 1700000000000
    for bad in ("", "x-1", "1-x", "-1", "1", "1700000000000", "1-"):
        with pytest.raises(InvalidArgument):
            positions.parse(bad)  # common.proto: anything but "ms-seq" is INVALID_ARGUMENT


def test_write_tokens_merge_and_cover() -> None:
    a = {0: "5-0", 1: "7-1"}
    b = {1: "7-0", 2: "1-0"}
    assert positions.merge_tokens(a, b) == {0: "5-0", 1: "7-1", 2: "1-0"}
    assert positions.covers({0: "6-0", 1: "7-1", 2: "1-0"}, positions.merge_tokens(a, b))
    assert not positions.covers({0: "6-0", 1: "7-0"}, a)
    assert not positions.covers({1: "9-0"}, a)  # shard 0 unknown
    assert positions.covers({}, {})
