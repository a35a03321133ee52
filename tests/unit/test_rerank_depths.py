"""Choosing the rerank depth from the bench's latency table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.common.errors import InvalidArgument, NotFound
from services.rerank.depths import (
    DEFAULT_DEPTH_TABLE,
    depth_for_budget,
    depth_table,
    load_depth_table,
)

TABLE = {10: 510.1, 20: 1025.6, 50: 2854.1, 100: 5348.5}


@pytest.mark.parametrize(
    ("budget_ms", "depth"),
    [(6000, 100), (5348.5, 100), (3000, 50), (1100, 20), (600, 10), (509, 0), (0, 0)],
)
def test_largest_measured_depth_within_budget(budget_ms: float, depth: int) -> None:
    assert depth_for_budget(budget_ms, TABLE) == depth


def test_reads_the_bench_file_and_a_bare_mapping(tmp_path: Path) -> None:
    bench = tmp_path / "bench.json"
    bench.write_text(
        json.dumps(
            {
                "ms_per_query_at_depth": {str(k): v for k, v in TABLE.items()},
                "source": {"bench": "rerank"},
            }
        )
    )
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"10": 5, "20": 9.5}))
    assert load_depth_table(bench) == TABLE
    assert load_depth_table(bare) == {10: 5.0, 20: 9.5}


def test_the_committed_bench_table_is_readable() -> None:
    repo = Path(__file__).resolve().parents[2]
    table = load_depth_table(repo / "bench" / "results" / "rerank_depths.json")
    assert set(table) == {10, 20, 50, 100} and table[10] < table[100]


def test_bad_tables_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(NotFound):
        load_depth_table(tmp_path / "missing.json")
    for bad in ({}, {"x": 1}, {"0": 1.0}, [1, 2]):
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(InvalidArgument):
            load_depth_table(tmp_path / "bad.json")


def test_the_default_table_is_the_committed_measurement() -> None:
    """No table configured: the bench's measurement, from this module and nowhere else."""
    repo = Path(__file__).resolve().parents[2]
    committed = load_depth_table(repo / "bench" / "results" / "rerank_depths.json")
    assert dict(DEFAULT_DEPTH_TABLE) == committed
    assert depth_table(None) == committed
    assert depth_for_budget(500.0, depth_table(None)) == 0, "below the smallest: skip"


def test_a_configured_table_is_read_and_never_replaced_by_the_default(tmp_path: Path) -> None:
    (tmp_path / "t.json").write_text(json.dumps({"3": 1.0}))
    assert depth_table(tmp_path / "t.json") == {3: 1.0}
    assert depth_table(str(tmp_path / "t.json")) == {3: 1.0}
    with pytest.raises(NotFound):
        depth_table(tmp_path / "missing.json")
    for unreadable in (b"{not json", b"\xff\xfe\x00"):
        (tmp_path / "t.json").write_bytes(unreadable)
        with pytest.raises(InvalidArgument, match="unreadable"):
            depth_table(tmp_path / "t.json")
