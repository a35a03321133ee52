"""services/generations/pacing.py and serving_latency.py: the re-embedding paced on the
searches' p99 the gateways report (a hand-moved clock; no sleeping: the pauses are
recorded, not slept)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from services.generations import pacing
from services.generations.pacing import Pacer
from services.generations.progress import Progress
from services.generations.serving_latency import (
    BASELINE_LAG_S,
    BASELINE_S,
    LatencySummary,
    LatencyWindow,
)
from tests.support.clock import Clock


class Noted(Progress):
    """Keeps the operator's lines."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def message(self, text: str) -> None:
        self.messages.append(text)


class Scene:
    """A pacer over a p99 the test sets (None: no gateway reports)."""

    def __init__(self, p99: float | None, **options: Any) -> None:
        self.p99 = p99
        self.clock = Clock()
        self.pauses: list[float] = []
        self.progress = Noted()

        async def sleep(seconds: float) -> None:
            self.pauses.append(seconds)

        self.pacer = Pacer(
            lambda: self.p99, self.progress, clock=self.clock, sleep=sleep, **options
        )

    def call(self, seconds: float = 0.2, then: float = 1.0) -> float:
        """One encode call of ``seconds``; the clock then moves ``then``; its pause."""
        before = len(self.pauses)
        asyncio.run(self.pacer.after_call(seconds))
        self.clock.now += then
        return self.pauses[before] if len(self.pauses) > before else 0.0


def test_without_a_baseline_nothing_is_paced() -> None:
    scene = Scene(None)
    scene.pacer.start()
    scene.p99 = 500.0  # searches appear later, slow: still no target to hold
    assert [scene.call() for _ in range(5)] == [0.0] * 5
    assert scene.pacer.figures.target_ms is None


def test_the_target_is_the_ratio_or_the_margin_whichever_is_more() -> None:
    fast, slow = Scene(10.0, ratio=1.3), Scene(100.0, ratio=1.3)
    fast.pacer.start()
    slow.pacer.start()
    assert fast.pacer.figures.target_ms == 15.0  # 10 + 5 ms, not 13
    assert slow.pacer.figures.target_ms == 130.0


def test_a_p99_over_the_target_halves_the_duty_once_per_settling_time() -> None:
    scene = Scene(30.0, ratio=1.3, settle_s=5.0)  # target 39 ms
    scene.pacer.start()
    assert scene.call() == 0.0  # under the target: full speed
    scene.p99 = 60.0
    assert scene.call(0.2) == pytest.approx(0.2)  # duty 0.5: as long a pause as the call
    # the reports still hold searches from before the cut: no second cut for 5 s
    assert [scene.call(0.2) for _ in range(4)] == [pytest.approx(0.2)] * 4
    assert scene.call(0.2) == pytest.approx(0.6)  # 5 s on and still over: duty 0.25
    assert scene.pacer.figures.cuts == 2
    messages = [m for m in scene.progress.messages if "over 39.0 ms" in m]
    assert len(messages) == 2, scene.progress.messages


def test_the_duty_never_falls_below_its_floor_and_recovers_under_the_target() -> None:
    scene = Scene(30.0, ratio=1.3, settle_s=0.0, min_duty=0.1)  # target 39 ms
    scene.pacer.start()
    scene.p99 = 45.0
    for _ in range(4):
        scene.call(0.1)  # 0.5, 0.25, 0.125, then the floor
    assert scene.pacer.duty == 0.1
    scene.p99 = 35.0  # under the target, not well under: held
    assert scene.call(0.1) == pytest.approx(0.9)  # 10 % busy
    assert scene.pacer.duty == 0.1
    scene.p99 = 20.0
    for _ in range(3):
        scene.call(0.1)
    assert scene.pacer.duty == pytest.approx(0.4)
    figures = scene.pacer.figures.as_dict()
    assert figures["lowest_duty"] == 0.1 and figures["cuts"] == 4 and figures["rebases"] == 0
    assert 0 < figures["duty"] < 1


def test_searches_still_slow_at_the_floor_rebase_the_target_until_they_recover() -> None:
    """Work the builder cannot shed (other jobs, the writes' dual encodes, steal) keeps
    the p99 up with the encoder at 10 %: pausing more would only stretch the rollout, so
    the target is taken again from that p99 (and the margin more, not the ratio: the
    re-embedding must not add the whole ratio on top), and the first one comes back with
    the searches' speed."""
    # target 39 ms; a ceiling over the p99s below (the next test has the default one)
    scene = Scene(30.0, ratio=1.3, ceiling=3.0, settle_s=5.0, min_duty=0.1)
    scene.pacer.start()
    scene.p99 = 80.0
    for _ in range(25):  # four cuts 5 s apart (0-15 s), read again from 20 s at the floor
        scene.call(0.1)
    assert scene.pacer.duty == 0.1 and scene.pacer.figures.cuts == 4
    assert scene.pacer.figures.rebases == 0  # over the target for 4 s at the floor only
    for _ in range(10):  # until 34 s: 14 s at the floor, still over
        scene.call(0.1)
    assert scene.pacer.figures.rebases == 0
    scene.call(0.1)
    assert scene.pacer.figures.rebases == 1
    assert scene.pacer.figures.target_ms == 85.0  # 80 + the 5-ms margin
    assert any("not what slows them" in m for m in scene.progress.messages)
    for _ in range(6):  # still 80 ms: over 0.8 x 85 = 68 ms, so the floor holds
        scene.call(0.1)
    assert scene.pacer.duty == 0.1 and scene.pacer.figures.rebases == 1
    scene.p99 = 60.0  # faster than the rebased target's relaxed share: the duty rises
    for _ in range(3):
        scene.call(0.1)
    assert scene.pacer.duty > 0.1
    scene.p99 = 25.0  # the other load has gone: the first target again
    scene.call(0.1)
    assert scene.pacer.figures.target_ms == 39.0


def test_a_burst_shorter_than_the_rebase_time_only_cuts_and_a_rebase_takes_the_lowest_p99() -> None:
    """A target's shard processes starting make the searches slow for a few seconds: the
    duty is cut, the target stays (a rebase then raised it to the burst's p99, and the
    duty climbed until the bulk read that p99). A p99 that stays over for the whole
    rebase time raises it, to the lowest p99 of that time and the margin more."""
    scene = Scene(30.0, ratio=1.3, ceiling=3.0, settle_s=0.0, min_duty=0.1, rebase_after_s=15.0)
    scene.pacer.start()  # target 39 ms
    scene.p99 = 130.0
    for _ in range(12):  # four cuts, then 8 s at the floor
        scene.call(0.1)
    assert scene.pacer.duty == 0.1 and scene.pacer.figures.rebases == 0
    scene.p99 = 30.0  # the burst is over: under 0.8 x 39, the duty rises again
    scene.call(0.1)
    assert scene.pacer.duty == pytest.approx(0.2)
    assert scene.pacer.figures.target_ms == 39.0 and scene.pacer.figures.rebases == 0

    for p99 in [130.0] * 4 + [60.0, 52.0, 70.0] + [65.0] * 10:  # floor, then 16 s over
        scene.p99 = p99
        scene.call(0.1)
    assert scene.pacer.figures.rebases == 1
    assert scene.pacer.figures.target_ms == 57.0  # the lowest, 52 ms, and the margin


def test_a_rebase_stops_at_the_ceiling_and_the_encoder_stays_at_its_floor() -> None:
    """What the rollout cannot shed takes the p99 to 1.6x: the target is raised to the
    ceiling (1.5x the baseline), not to that p99 and the margin, so the duty stays at the
    floor instead of climbing while the searches are over the rollout's SLO; another
    15 s over the ceiling raise nothing (nor say it again)."""
    scene = Scene(20.0, ratio=1.2, settle_s=5.0, min_duty=0.1)  # target 25 ms (+5 ms)
    scene.pacer.start()
    scene.p99 = 32.0
    for _ in range(36):  # four cuts (0-15 s), then 15 s over at the floor: a rebase
        scene.call(0.1)
    assert scene.pacer.figures.rebases == 1
    assert scene.pacer.figures.target_ms == 30.0  # 1.5 x 20, not 32 + 5
    assert any("ceiling" in m for m in scene.progress.messages)
    said = len(scene.progress.messages)
    scene.p99 = 28.0  # under the ceiling, over its relaxed share (24 ms): the floor holds
    for _ in range(40):
        scene.call(0.1)
    assert scene.pacer.duty == 0.1
    scene.p99 = 31.0  # over the ceiling again, for longer than a rebase takes
    for _ in range(40):
        scene.call(0.1)
    assert scene.pacer.figures.rebases == 1 and scene.pacer.figures.target_ms == 30.0
    assert len(scene.progress.messages) == said  # nothing raised, nothing said


def test_a_ratio_over_the_ceiling_is_its_own_ceiling() -> None:
    """``--pace 2``: the operator's ratio is the bound; a rebase cannot raise it."""
    scene = Scene(20.0, ratio=2.0, settle_s=5.0, min_duty=0.1)  # target 40 ms
    scene.pacer.start()
    scene.p99 = 60.0
    for _ in range(60):
        scene.call(0.1)
    assert scene.pacer.duty == 0.1
    assert scene.pacer.figures.rebases == 0 and scene.pacer.figures.target_ms == 40.0


def test_the_reports_are_read_at_most_once_a_second() -> None:
    reads = 0

    def read() -> float:
        nonlocal reads
        reads += 1
        return 30.0

    pacer = Pacer(read, Progress(), clock=Clock(), sleep=lambda s: asyncio.sleep(0))
    pacer.start()
    for _ in range(50):
        asyncio.run(pacer.after_call(0.01))  # the clock does not move
    assert reads == 2  # the baseline, and one check


def test_the_window_keeps_only_its_last_seconds_and_gives_their_percentiles() -> None:
    clock = Clock()
    window = LatencyWindow(window_s=5.0, clock=clock, baseline_s=5.0, baseline_lag_s=0.0)
    assert window.summary() == LatencySummary(0, 0.0, 0.0)
    for ms in range(1, 101):
        window.record(float(ms))
    clock.now += 4.0
    window.record(1000.0)
    summary = window.summary()
    assert summary.searches == 101 and summary.p99_ms > 99 and summary.p50_ms == 51.0
    clock.now += 2.0  # the first hundred are now 6 s old
    assert window.summary() == LatencySummary(1, 1000.0, 1000.0, 0.0, 1, 1000.0)
    again = LatencySummary.from_json(LatencySummary(3, 1.5, 9.25, at=12.0).to_json())
    assert again == LatencySummary(3, 1.5, 9.25, at=12.0)


def test_an_inactive_pacer_lets_calls_pass_and_counts_nothing() -> None:
    """The builder turns it off outside PACED_PHASES (the catch-up, the switch)."""
    scene = Scene(30.0, settle_s=0.0)
    scene.pacer.start()
    scene.p99 = 500.0
    scene.call()  # a cut: duty 0.5
    scene.pacer.active = False
    assert scene.call() == 0.0 and scene.pacer.figures.busy_s == pytest.approx(0.2)
    assert {"train", "bulk"} == pacing.PACED_PHASES


def test_the_window_also_gives_the_p99_of_its_longer_baseline() -> None:
    clock = Clock()
    window = LatencyWindow(window_s=5.0, clock=clock, baseline_s=30.0, baseline_lag_s=0.0)
    for ms in range(1, 201):  # 200 searches, 20 s before the last five seconds
        window.record(float(ms))
    clock.now += 20.0
    for _ in range(100):
        window.record(10.0)
    summary = window.summary()
    assert (summary.searches, summary.p99_ms) == (100, 10.0)  # the last 5 s alone
    assert summary.baseline_searches == 300 and summary.baseline_p99_ms > 190
    clock.now += 11.0  # the first 200 are now 31 s old: out of both windows
    assert window.summary().baseline_searches == 100
    clock.now += 20.0
    assert window.summary() == LatencySummary(0, 0.0, 0.0)
    old = '{"n": 3, "p50": 1.5, "p99": 9.25, "at": 12.0}'  # a gateway with no baseline
    assert LatencySummary.from_json(old) == LatencySummary(3, 1.5, 9.25, at=12.0)


def test_the_baseline_leaves_out_the_last_seconds_where_the_rollout_starts() -> None:
    """A burst in the last BASELINE_LAG_S (the rollout CLI's own start) is not in the
    baseline; the 30 s before it are, and the 5-s window still sees the burst."""
    clock = Clock()
    window = LatencyWindow(window_s=5.0, clock=clock)
    assert (window.baseline_s, window.baseline_lag_s) == (BASELINE_S, BASELINE_LAG_S) == (30, 15)
    for _ in range(50):  # 50 s of steady searches, 20 a second, 20 ms each
        for _ in range(20):
            window.record(20.0)
            clock.now += 0.05
    for _ in range(60):  # then 3 s of a burst at 300 ms
        window.record(300.0)
        clock.now += 0.05
    summary = window.summary()
    assert summary.p99_ms == 300.0  # the pacing window sees it
    assert summary.baseline_p99_ms == 20.0 and 595 <= summary.baseline_searches <= 605
    clock.now += 15.0  # the burst is now older than the lag: in the baseline
    assert window.summary().baseline_p99_ms == 300.0
    unlagged = LatencyWindow(window_s=5.0, clock=clock, baseline_lag_s=0.0)
    for ms in (20.0,) * 200 + (300.0,) * 60:
        unlagged.record(ms)
    assert unlagged.summary().baseline_p99_ms == 300.0  # what the lag is for


def test_a_busy_gateway_still_keeps_its_whole_lagged_baseline() -> None:
    """At 600 searches a second the window holds the 45 s the lagged baseline needs (the
    cap of 20,000 from before the lag kept 33 s: 18 of the baseline's 30)."""
    clock = Clock()
    window = LatencyWindow(clock=clock)
    for _ in range(45 * 600):
        window.record(20.0)
        clock.now += 1 / 600
    summary = window.summary()
    assert summary.baseline_searches >= 30 * 600 - 5, summary


def test_the_baseline_is_read_from_the_longer_window_the_control_from_the_last() -> None:
    reads: list[str] = []

    def read() -> float:
        reads.append("window")
        return 60.0

    def baseline() -> float:
        reads.append("baseline")
        return 30.0

    clock = Clock()
    pacer = Pacer(read, Progress(), ratio=1.3, read_baseline=baseline, clock=clock, sleep=_no_sleep)
    pacer.start()
    assert pacer.figures.baseline_ms == 30.0 and pacer.figures.target_ms == 39.0
    asyncio.run(pacer.after_call(0.1))
    assert reads == ["baseline", "window"] and pacer.duty == 0.5  # 60 ms > 39: a cut


async def _no_sleep(seconds: float) -> None:
    return None


def test_a_rollout_is_paced_unless_told_off_and_a_rollback_never() -> None:
    from services.cli.generation_commands import PACE
    from services.cli.main import build_parser
    from services.generations.context import RolloutOptions

    parser = build_parser()
    assert PACE == pacing.DEFAULT_RATIO == RolloutOptions(index_root=Path(".")).pace_ratio
    assert parser.parse_args(["index", "rollout", "--retrain"]).pace == pacing.DEFAULT_RATIO
    assert parser.parse_args(["index", "rollout", "--retrain", "--pace", "off"]).pace is None
    assert parser.parse_args(["index", "rollout", "--retrain", "--pace", "1.5"]).pace == 1.5
    assert getattr(parser.parse_args(["index", "rollback"]), "pace", None) is None
    with pytest.raises(SystemExit):
        parser.parse_args(["index", "rollout", "--retrain", "--pace", "1"])
