"""SlotTable: FAISS id → slot with batch operations, checked against a dict."""

from __future__ import annotations

import numpy as np
import pytest

from services.index.core.slots import MIN_BUCKETS, SlotTable


def test_random_adds_and_removes_match_a_dict() -> None:
    rng = np.random.default_rng(7)
    table, model = SlotTable(), dict[int, int]()
    pool = rng.integers(0, 2**63 - 1, size=6000, dtype=np.int64)
    # a few ids on the same bucket, so that probe paths are long and cross deleted entries
    pool[:40] = (np.arange(40, dtype=np.int64) << 20) | 5
    next_slot = 0
    for _ in range(300):
        absent = [f for f in rng.choice(pool, 40, replace=False).tolist() if f not in model]
        slots = np.arange(next_slot, next_slot + len(absent))
        next_slot += len(absent)
        table.add(np.array(absent, dtype=np.int64), slots)
        model.update(zip(absent, slots.tolist(), strict=True))
        gone = rng.choice(pool, 25, replace=False)
        got = table.remove(gone)
        assert got.tolist() == [model.pop(f, -1) for f in gone.tolist()]
        probe = np.concatenate([rng.choice(pool, 200), [-1, -5]])
        assert table.lookup(probe).tolist() == [model.get(f, -1) for f in probe.tolist()]
        assert len(table) == len(model)
    fids, slots = table.items()
    assert dict(zip(fids.tolist(), slots.tolist(), strict=True)) == model
    assert all((f in table) == (f in model) for f in pool[:100].tolist())


def test_grows_past_its_first_size_and_keeps_the_shape_of_a_lookup() -> None:
    table = SlotTable()
    n = 3 * MIN_BUCKETS
    fids = np.arange(n, dtype=np.int64) * 1_000_003
    table.add(fids, np.arange(n))
    assert len(table) == n
    grid = fids[:12].reshape(3, 4)
    assert table.lookup(grid).tolist() == np.arange(12).reshape(3, 4).tolist()


def test_add_refuses_what_would_corrupt_the_table() -> None:
    table = SlotTable()
    table.add(np.array([3, 9]), np.array([0, 1]))
    with pytest.raises(ValueError, match="distinct and not present"):
        table.add(np.array([9]), np.array([2]))
    with pytest.raises(ValueError, match="distinct and not present"):
        table.add(np.array([4, 4]), np.array([2, 3]))
    with pytest.raises(ValueError, match="non-negative"):
        table.add(np.array([-7]), np.array([2]))
    assert table.lookup(np.array([3, 9, 4])).tolist() == [0, 1, -1]
