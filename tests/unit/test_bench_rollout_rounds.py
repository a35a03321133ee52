"""bench/rollout_rounds.py: the rounds' segments, their searches and their cores pooled."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from bench.rollout_rounds import by_segment, pooled_cores, segment_windows


def test_the_rounds_segments_pool_their_cores_with_each_rounds_generations_named() -> None:
    samples = [
        (float(t), {"shards g2": t * 0.5, "shards g3": t * 0.25, "machine": t * 1.0})
        for t in range(11)
    ]
    rounds = [
        {
            "start": 1.0,
            "end": 4.0,
            "seen": {"train": 2.0},
            "names": {"source": "g2", "target": "g3"},
        },
        {
            "start": 6.0,
            "end": 9.0,
            "seen": {"train": 8.0},
            "names": {"source": "g3", "target": "g4"},
        },
    ]
    windows = segment_windows(rounds)
    assert [(a, b) for a, b, _ in windows["train"]] == [(2.0, 4.0), (8.0, 9.0)]
    train = pooled_cores(windows["train"], samples)
    # 3 s in all: g2 as source 2 s at 0.5; g3 as target 2 s at 0.25, as source 1 s at 0.25
    assert train["shards source"] == pytest.approx((1.0 + 0.25) / 3, abs=0.01)
    assert train["shards target"] == pytest.approx(0.5 / 3, abs=0.01)
    assert train["machine"] == 1.0
    assert pooled_cores([(20.0, 21.0, None)], samples) is None


def _search(start: float, generation: str, latency: float) -> Any:
    return SimpleNamespace(
        start=start, generation=generation, code="OK", latency=latency, stages={}
    )


def test_a_segments_slow_searches_are_timed_from_their_rounds_first_target_answer() -> None:
    rounds = [
        {
            "start": 1.0,
            "end": 4.0,
            "seen": {"train": 2.0, "switch": 3.0},
            "names": {"source": "g2", "target": "g3"},
            "wall": (100.0, 103.0),
        },
        {
            "start": 6.0,
            "end": 9.0,
            "seen": {"train": 7.0, "switch": 8.0},
            "names": {"source": "g3", "target": "g4"},
            "wall": (200.0, 203.0),
        },
    ]
    searches = [
        _search(1.5, "g2", 0.01),
        _search(3.2, "g3", 0.01),  # round 1's target answers first at 3.2
        _search(3.5, "g3", 0.2),
        _search(8.4, "g4", 0.01),  # round 2's at 8.4
        _search(8.6, "g4", 0.3),
    ]
    switch = by_segment(searches, rounds, slow_s=0.1)["switch"]
    assert switch["searches"] == 4 and switch["slow"] == 2 and switch["slow_on_target"] == 2
    assert switch["slow_from_switch_ms"] == [200, 300]  # each from its own round's first
    assert switch["slow_wall_s"] == [102.5, 202.6]
    assert by_segment(searches, rounds, slow_s=0.1)["start"]["searches"] == 1
