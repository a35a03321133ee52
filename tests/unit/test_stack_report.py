"""loadtest.stack_report's arithmetic and the workload's retrieval mode (no stack: the
report itself is run by hand, docs/performance.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from loadtest.local_up import write_corpus
from loadtest.stack_report import (
    LOADED_OTHER_CORES,
    MODES,
    STEAL_CORES,
    add_ratios,
    floor_summary,
    summary_lines,
)
from loadtest.workload import Workload
from retrieval.v1 import search_pb2


def _mode(ceiling: float, cpu_ms: float | None, slo_rate: float | None) -> dict[str, Any]:
    return {
        "ceiling": {"searches_per_s": ceiling, "cpu_ms_per_search": cpu_ms},
        "slo_rate": slo_rate,
        "slo_rate_over_ceiling": (slo_rate or 0.0) / ceiling,
    }


def _report(other: float) -> dict[str, Any]:
    return {
        "loadavg_before": (0.1, 0.1, 0.1),
        "loadavg_after": (0.9, 0.5, 0.2),
        "overhead": {"max_sustained_rate": 3000.0, "added_p50_ms": 0.9},
        "modes": {"hybrid": _mode(100.0, 20.0, 70.0), "dense": _mode(120.0, 16.0, None)},
        "floor": {"hybrid": {"cpu_ms_per_search": 12.5}, "dense": {"cpu_ms_per_search": 8.0}},
        "cores": {"machine": 1.9, "other": other},
    }


def test_the_default_modes_figures_are_named_at_the_top_level() -> None:
    out = _report(other=0.05)
    add_ratios(out)
    assert out["cpu_per_search_over_floor"] == pytest.approx(20.0 / 12.5)
    assert out["modes"]["dense"]["cpu_per_search_over_floor"] == pytest.approx(2.0)
    assert out["hybrid_slo_rate"] == 70.0
    assert out["slo_rate_over_ceiling"] == pytest.approx(0.7)
    assert out["loaded"] is False
    lines = "\n".join(summary_lines(out))
    assert "hybrid_slo_rate 70.0/s" in lines and "LOADED" not in lines


def test_a_run_beside_other_work_says_so() -> None:
    out = _report(other=LOADED_OTHER_CORES + 0.1)
    add_ratios(out)
    assert out["loaded"] is True
    assert "LOADED" in summary_lines(out)[0]


@pytest.mark.parametrize("where", ["stack", "floor"])
def test_a_run_on_stolen_cores_says_so_wherever_the_steal_fell(where: str) -> None:
    """The hypervisor's steal slows every figure without any process of ours or another
    job's showing it: past STEAL_CORES, during the stack's part or the floor's, LOADED."""
    out = _report(other=0.0)
    if where == "stack":
        out["cores"]["steal"] = STEAL_CORES + 0.05
    else:
        out["floor_steal_cores"] = STEAL_CORES + 0.05
    add_ratios(out)
    assert out["loaded"] is True and out["steal_cores"] == pytest.approx(STEAL_CORES + 0.05)
    assert "LOADED" in summary_lines(out)[0]


@pytest.mark.parametrize(("drift", "loaded"), [(1.2, False), (1.3, True), (0.7, True)])
def test_a_floor_that_drifted_over_the_run_says_the_machine_changed_speed(
    drift: float, loaded: bool
) -> None:
    out = _report(other=0.0)
    out["floor_drift"] = drift
    add_ratios(out)
    assert out["loaded"] is loaded
    assert ("LOADED" in summary_lines(out)[0]) is loaded


def test_the_floor_is_the_mean_of_its_runs_before_and_after_the_stack() -> None:
    first: dict[str, Any] = {m: {"cpu_ms_per_search": 4.0} for m in MODES}
    last: dict[str, Any] = {m: {"cpu_ms_per_search": 6.0} for m in MODES}
    floor = floor_summary(first, last)
    assert floor["hybrid"]["cpu_ms_per_search"] == pytest.approx(5.0)
    assert (floor["dense"]["before_ms"], floor["dense"]["after_ms"]) == (4.0, 6.0)


def test_without_cpu_figures_the_floor_ratio_is_absent_not_zero() -> None:
    out = _report(other=0.0)
    out["modes"]["hybrid"]["ceiling"]["cpu_ms_per_search"] = None  # --stack-json
    del out["floor"]
    add_ratios(out)
    assert out["cpu_per_search_over_floor"] is None
    assert "cpu_per_search_over_floor -" in "\n".join(summary_lines(out))


def test_a_workload_sends_the_mode_it_was_given() -> None:
    for mode, wire in (
        ("", search_pb2.RETRIEVAL_MODE_UNSPECIFIED),
        ("dense", search_pb2.RETRIEVAL_MODE_DENSE),
        ("hybrid", search_pb2.RETRIEVAL_MODE_HYBRID),
    ):
        _, messages = Workload(queries=["q"], mode=mode).requests(3, seed=1)  # type: ignore[arg-type]
        assert all(isinstance(m, search_pb2.SearchRequest) and m.mode == wire for m in messages)
    with pytest.raises(ValueError, match="mode"):
        Workload(queries=["q"], mode="exact")  # type: ignore[arg-type]


def test_the_corpus_is_the_first_documents_of_the_collection(tmp_path: Path) -> None:
    source = tmp_path / "beir"
    source.mkdir()
    (source / "corpus.jsonl").write_text("".join(f'{{"_id": "{i}"}}\n' for i in range(5)))
    written = write_corpus(source, tmp_path / "c.jsonl", 3)
    assert written.read_text().splitlines() == ['{"_id": "0"}', '{"_id": "1"}', '{"_id": "2"}']
