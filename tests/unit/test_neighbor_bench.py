"""bench.neighbor's arithmetic: each scenario's percentiles as ratios to no neighbour."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench import neighbor


def test_each_scenario_is_read_against_the_runs_without_a_neighbour() -> None:
    base = [float(v) for v in range(1, 101)]  # p50 50.5, p99 99.01
    slower = [2 * v for v in base]
    rows = neighbor.summarise({"none": base, "other_cpu_encode": slower})
    assert rows["none"]["p50_over_none"] == 1.0
    assert rows["other_cpu_encode"]["p50_over_none"] == pytest.approx(2.0)
    assert rows["other_cpu_encode"]["p99_over_none"] == pytest.approx(2.0)
    assert rows["other_cpu_encode"]["p50_ms"] == pytest.approx(101.0)


def test_no_neighbour_starts_no_process() -> None:
    assert neighbor._start("none", Path("unused.onnx"), []) is None


def test_every_scenario_names_where_its_neighbour_runs() -> None:
    for scenario in neighbor.SCENARIOS[1:]:
        assert scenario.startswith(("other_cpu_", "same_cpu_")), scenario
        assert "encode" in scenario or scenario.endswith("spin"), scenario


def test_keep_warm_spinners_run_idle_class_on_each_cpu_and_stop() -> None:
    from bench.keep_warm import KeepWarm

    warm = KeepWarm.start({0})
    try:
        (proc,) = warm.procs
        assert os.sched_getscheduler(proc.pid) == os.SCHED_IDLE
        assert os.sched_getaffinity(proc.pid) == {0}
    finally:
        warm.stop()
    assert warm.procs == [] and proc.returncode is not None


def test_keep_warm_ratios_pair_each_round() -> None:
    from bench.keep_warm import _ratios

    off = [{"p50_ms": 10.0, "p99_ms": 40.0, "slo_attainment": 0.995}] * 2
    on = [
        {"p50_ms": 12.0, "p99_ms": 80.0, "slo_attainment": 0.9},
        {"p50_ms": 11.0, "p99_ms": 60.0, "slo_attainment": 0.95},
    ]
    row = _ratios({"off": off, "on": on})
    assert row["p99_ms_on_over_off"] == {"median": 1.75, "min": 1.5, "max": 2.0}
    assert row["within_slo_on"] == 0.9 and row["within_slo_off"] == 0.995
