"""The text index's refresh (services/index/core/shard.py, services/index/server/refresh.py):
a batch is searchable densely at once and sparsely at the refresh, which runs outside the
shard's write lock; ``applied`` moves only at the refresh; a delete's text never comes
back meanwhile (an upsert's old text may, until the refresh); a snapshot refreshes first;
the consumer's schedule."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from services.index.core.changes import Delete, Upsert
from services.index.core.shard import IvfPqShard
from services.index.core.snapshots import load_newest, write_snapshot
from services.index.core.text import TextConfig, TextIndex
from services.index.core.trained import TrainedIndex
from services.index.server.refresh import Refresher
from tests.support.clock import Clock
from tests.support.shards import trained, vectors

__all__ = ["trained", "vectors"]  # the module-scoped fixtures, shared


def sparse(shard: IvfPqShard, query: str) -> list[str]:
    return [d for d, _ in shard.search_text(shard.query_terms([query]), 5).hits()[0]]


def dense(shard: IvfPqShard, vector: np.ndarray) -> list[str]:
    return [d for d, _ in shard.search(vector[None, :], 1)[0]]


@pytest.fixture
def shard(trained: TrainedIndex, tmp_path: Path) -> IvfPqShard:
    shard = IvfPqShard(trained, TextIndex.create(tmp_path / "text"))
    shard.apply([Upsert("a", trained_vector(trained, 0), body="zebra crossing")], "1-0")
    return shard


def trained_vector(trained: TrainedIndex, seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(trained.manifest.dim).astype(np.float32)
    return v / np.linalg.norm(v)


def test_a_staged_batch_is_dense_at_once_and_sparse_at_the_refresh(
    shard: IvfPqShard, trained: TrainedIndex
) -> None:
    b = trained_vector(trained, 1)
    shard.apply([Upsert("b", b, body="okapi"), Delete("a")], "2-0", refresh=False)
    assert dense(shard, b) == ["b"]
    assert sparse(shard, "okapi") == []  # not searchable in the text yet
    assert sparse(shard, "zebra") == []  # and the deleted one's text never comes back
    assert (shard.staged, shard.applied, shard.pending) == ("2-0", "1-0", True)
    shard.refresh()
    assert sparse(shard, "okapi") == ["b"]
    assert (shard.applied, shard.pending) == ("2-0", False)


def test_an_upserts_new_text_replaces_the_old_at_the_refresh(
    shard: IvfPqShard, trained: TrainedIndex
) -> None:
    """Until the refresh the document is found by its old text (the id is live, the
    deletion of its old text staged): near-real-time, as Lucene's refresh; never after."""
    shard.apply([Upsert("a", trained_vector(trained, 0), body="giraffe")], "2-0", refresh=False)
    assert (sparse(shard, "zebra"), sparse(shard, "giraffe")) == (["a"], [])
    shard.refresh()
    assert (sparse(shard, "zebra"), sparse(shard, "giraffe")) == ([], ["a"])


@pytest.fixture
def slow_commit(shard: IvfPqShard, monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """The text index's commit held until the event is set (a commit that takes long)."""
    assert shard.text is not None
    go, inside = threading.Event(), threading.Event()
    commit = shard.text.refresh

    def held() -> None:
        inside.set()
        assert go.wait(30)
        commit()

    monkeypatch.setattr(shard.text, "refresh", held)
    yield inside
    go.set()


def test_searches_go_on_while_a_batch_commits(
    shard: IvfPqShard, trained: TrainedIndex, slow_commit: threading.Event
) -> None:
    """The commit runs outside the write lock: with it stuck, dense and sparse searches
    answer (with the commit under the lock, as before, both waited for it)."""
    b = trained_vector(trained, 1)
    writer = threading.Thread(
        target=shard.apply, args=([Upsert("b", b, body="okapi")], "2-0"), daemon=True
    )
    writer.start()
    assert slow_commit.wait(30)
    answers: list[list[str]] = []
    reader = threading.Thread(
        target=lambda: answers.extend([dense(shard, b), sparse(shard, "zebra")]), daemon=True
    )
    reader.start()
    reader.join(10)
    assert answers == [["b"], ["a"]], "the searches waited for the commit"
    assert shard.applied == "1-0"  # not before its text is searchable


def test_a_snapshot_refreshes_first(
    shard: IvfPqShard, trained: TrainedIndex, tmp_path: Path
) -> None:
    shard.apply([Upsert("b", trained_vector(trained, 1), body="okapi")], "2-0", refresh=False)
    write_snapshot(shard, tmp_path / "snaps", keep=2)
    assert (shard.applied, shard.pending) == ("2-0", False)
    restored, snap = load_newest(tmp_path / "snaps", trained, TextConfig(tmp_path / "restored"))
    assert snap is not None and snap.position == "2-0"
    assert (restored.applied, restored.staged) == ("2-0", "2-0")
    assert sparse(restored, "okapi") == ["b"]


def test_the_schedule_counts_from_the_first_change_left_unrefreshed(
    shard: IvfPqShard, trained: TrainedIndex
) -> None:
    clock = Clock()
    refresher = Refresher(0.25, clock)
    assert not refresher.due(shard)  # nothing staged
    clock.now = 10.0
    shard.apply([Upsert("b", trained_vector(trained, 1), body="okapi")], "2-0", refresh=False)
    refresher.applied(oldest_entry_ms=0)
    clock.now = 10.2
    shard.apply([Upsert("c", trained_vector(trained, 2), body="emu")], "3-0", refresh=False)
    refresher.applied(oldest_entry_ms=0)
    assert not refresher.due(shard)  # 0.2 s since the first: the second joins it
    clock.now = 10.25
    assert refresher.due(shard)
    assert refresher.refresh(shard) is not None
    assert (shard.applied, refresher.refreshes, sparse(shard, "emu")) == ("3-0", 1, ["c"])
    assert not refresher.due(shard)
    assert refresher.refresh(shard) is None  # nothing new: no lag to report
    assert refresher.refreshes == 1  # and no commit counted


def test_every_batch_is_due_at_zero(shard: IvfPqShard, trained: TrainedIndex) -> None:
    refresher = Refresher(0.0, Clock())
    shard.apply([Upsert("b", trained_vector(trained, 1), body="okapi")], "2-0", refresh=False)
    refresher.applied(oldest_entry_ms=0)
    assert refresher.due(shard)
