"""The rollout builder's idempotent appends into a target generation's logs
(services/generations/append.py) on a real Redis and a real Redis Cluster: nothing is
appended twice, an older version never overtakes a newer one, a reshard copies the
documents and raises the version counters, and a batch run again after a crash leaves the
logs as an uninterrupted run does."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from services.generations.append import (
    RETRAIN_VERSION,
    SCRIPT_BYTES,
    SCRIPT_ITEMS,
    DeleteItem,
    TargetAppender,
    UpsertItem,
    meta_json,
)
from services.index.changelog import decode_entry
from services.index.keys import GenerationKeys, Layout
from tests.support.generation_logs import changes, folded, two_shard_store

DIM = 8
SAME = GenerationKeys("g2", Layout(2, base=2))
RESHARD = GenerationKeys("g3", Layout(3, base=2))


@pytest.fixture
def client(any_redis_url: str) -> Iterator[Any]:
    with two_shard_store(any_redis_url) as c:
        yield c


def _vec(seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)
    return v / np.linalg.norm(v)


def _up(doc_id: str, version: int, seed: int = 0, text: str = "") -> UpsertItem:
    return UpsertItem(
        doc_id,
        version,
        _vec(seed),
        title=f"t-{doc_id}",
        text=text or f"body of {doc_id}",
        meta=meta_json({"lang": "en"}),
    )


def test_an_upsert_is_appended_once_and_an_older_version_never_overtakes(client: Any) -> None:
    appender = TargetAppender(client, SAME, copy_documents=False)
    ids = [f"d{i}" for i in range(20)]
    first = appender.upserts([_up(i, 3, n) for n, i in enumerate(ids)])
    assert first.count == 20 and set(first.entries) <= {0, 1}
    # The same batch again (a builder killed after the script, before saving its cursor).
    assert appender.upserts([_up(i, 3, n) for n, i in enumerate(ids)]).count == 0
    # An older version (a bulk read racing a replayed newer write) is dropped; a newer one goes in.
    assert appender.upserts([_up("d0", 2, 99)]).count == 0
    assert appender.upserts([_up("d1", 4, 7, text="new")]).ids == ["d1"]
    logged = changes(client, SAME)
    assert sorted(logged) == sorted([(i, "u", 3) for i in ids] + [("d1", "u", 4)])
    state = folded(client, SAME)
    assert state["d1"][0] == 4 and state["d1"][1] == "t-d1 new"
    assert state["d0"][2] == tuple(round(float(x), 4) for x in _vec(0))
    # Same layout: the documents are the source's; nothing is copied.
    assert client.exists(SAME.layout.doc("d0")) == 0


def test_entries_read_as_the_writers_entries(client: Any) -> None:
    """A target shard applies the builder's entries with the same decoder as the gateway's."""
    appender = TargetAppender(client, SAME, copy_documents=False)
    out = appender.upserts([_up("a", 5, 1), _up("b", 6, 2)])
    for shard, entry in out.entries.items():
        [(_, fields)] = client.xrange(SAME.log(shard), min=entry, max=entry)
        for change in decode_entry(fields):
            assert change.version in (5, 6) and change.tags == {"lang": "en"}  # type: ignore[union-attr]


def test_a_long_batch_goes_in_as_short_scripts_of_one_entry_each(client: Any) -> None:
    """A script holds Redis while it runs (every serving command waits): a batch is cut
    into entries of at most SCRIPT_ITEMS items and about SCRIPT_BYTES, every document
    appended once. One script of 256 retrain upserts held Redis 16-32 ms."""
    appender = TargetAppender(client, SAME, copy_documents=False)
    short = [f"s{i}" for i in range(3 * SCRIPT_ITEMS)]  # the item bound cuts these
    long = [f"l{i}" for i in range(30)]  # 10,000-character texts: the byte bound cuts these
    big = "x" * 10_000
    assert appender.upserts([_up(i, 1, n) for n, i in enumerate(short)]).count == len(short)
    assert appender.upserts([_up(i, 1, n, text=big) for n, i in enumerate(long)]).count == 30
    assert appender.deletes([DeleteItem(i, 2) for i in short]).count == len(short)
    sizes: dict[str, list[int]] = {"short": [], "long": [], "delete": []}
    for shard in (0, 1):
        for _, fields in client.xrange(SAME.log(shard)):
            ids = [str(i) for i in json.loads(fields[b"ids"])]
            kind = "delete" if fields[b"op"] == b"d" else "long" if ids[0][0] == "l" else "short"
            sizes[kind].append(len(ids))
            assert len(ids) <= SCRIPT_ITEMS
            assert len(fields.get(b"texts", b"")) <= SCRIPT_BYTES
    # one entry per shard for each batch would be 2 entries of ~24 and of 15
    assert sum(sizes["short"]) == len(short) and len(sizes["short"]) >= 4
    assert sum(sizes["long"]) == 30 and max(sizes["long"]) <= SCRIPT_BYTES // len(big)
    assert sum(sizes["delete"]) == len(short) and len(sizes["delete"]) >= 4
    logged = changes(client, SAME)
    assert sorted(logged) == sorted(
        [(i, "u", 1) for i in short + long] + [(i, "d", 2) for i in short]
    )


def test_deletes_are_ordered_by_version_with_the_upserts(client: Any) -> None:
    appender = TargetAppender(client, SAME, copy_documents=False)
    appender.upserts([_up("x", 3), _up("y", 3)])
    assert appender.deletes([DeleteItem("x", 4)]).ids == ["x"]
    assert appender.deletes([DeleteItem("x", 4)]).count == 0  # again: nothing
    assert appender.upserts([_up("x", 3)]).count == 0  # the deleted version cannot come back
    assert appender.deletes([DeleteItem("y", 2)]).count == 0  # older than the upsert held
    assert appender.upserts([_up("x", 5)]).ids == ["x"]  # re-upserted after the delete
    assert set(folded(client, SAME)) == {"x", "y"}
    assert folded(client, SAME)["x"][0] == 5


def test_a_reused_vector_of_version_0_is_overtaken_by_every_real_version(client: Any) -> None:
    appender = TargetAppender(client, SAME, copy_documents=False)
    assert appender.upserts([_up("r", RETRAIN_VERSION, 1)]).count == 1
    assert appender.upserts([_up("r", RETRAIN_VERSION, 1)]).count == 0
    assert appender.upserts([_up("r", 1, 2)]).count == 1
    assert folded(client, SAME)["r"][0] == 1


def test_a_reshard_copies_the_documents_and_raises_the_version_counters(client: Any) -> None:
    appender = TargetAppender(client, RESHARD, copy_documents=True)
    client.set(RESHARD.layout.version("k"), 9)  # a counter already past the copied version
    appender.upserts([_up("c", 7, 1), _up("k", 4, 2)])
    doc = client.hgetall(RESHARD.layout.doc("c"))
    assert doc == {
        b"title": b"t-c",
        b"text": b"body of c",
        b"meta": b'{"lang": "en"}',
        b"ver": b"7",
    }
    assert RESHARD.layout.doc("c").startswith("doc:{3.")
    assert int(client.get(RESHARD.layout.version("c"))) == 7
    assert int(client.get(RESHARD.layout.version("k"))) == 9  # raised only, never lowered
    appender.deletes([DeleteItem("c", 8)])
    assert client.exists(RESHARD.layout.doc("c")) == 0
    assert int(client.get(RESHARD.layout.version("c"))) == 8
    # Every key of a document sits in its target shard's slot: a cluster ran the script.
    assert {shard for shard in range(3) if client.xlen(RESHARD.log(shard))} == {
        RESHARD.layout.shard("c"),
        RESHARD.layout.shard("k"),
    }


def _batches() -> list[list[UpsertItem | DeleteItem]]:
    """A bulk pass of 60 documents in 3 batches, then a replay: 10 newer upserts and 5 deletes."""
    bulk: list[list[UpsertItem | DeleteItem]] = [
        [_up(f"doc{n}", 1 + n % 3, n) for n in range(start, start + 20)] for start in (0, 20, 40)
    ]
    replay: list[UpsertItem | DeleteItem] = [_up(f"doc{n}", 10, 100 + n) for n in range(0, 10)]
    replay += [DeleteItem(f"doc{n}", 11) for n in range(50, 55)]
    return [*bulk, replay]


def _apply(appender: TargetAppender, batch: list[UpsertItem | DeleteItem]) -> None:
    appender.upserts([b for b in batch if isinstance(b, UpsertItem)])
    appender.deletes([b for b in batch if isinstance(b, DeleteItem)])


@pytest.mark.parametrize("target", [SAME, RESHARD], ids=["same-layout", "reshard"])
def test_batches_run_again_after_a_crash_leave_the_logs_of_an_uninterrupted_run(
    client: Any, target: GenerationKeys
) -> None:
    batches = _batches()
    straight = GenerationKeys(target.name + "0", target.layout)  # g20 / g30: a clean twin
    for batch in batches:
        _apply(TargetAppender(client, straight, copy_documents=target is RESHARD), batch)
    # The crashed run: batches 0 and 1 appended, the cursor saved after batch 0 only; the
    # builder starts again from batch 1 (a new appender: a new process).
    crashed = TargetAppender(client, target, copy_documents=target is RESHARD)
    _apply(crashed, batches[0])
    _apply(crashed, batches[1])
    resumed = TargetAppender(client, target, copy_documents=target is RESHARD)
    for batch in batches[1:]:
        _apply(resumed, batch)
    assert folded(client, target) == folded(client, straight)
    assert sorted(changes(client, target)) == sorted(changes(client, straight))
    logged = changes(client, target)
    assert len(logged) == len(set(logged)) == 60 + 10 + 5  # no (id, version) twice
