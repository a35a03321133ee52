"""The event loop watch (services/process/loop_watch.py) on a real loop: code holding the
loop is reported once, with its stack and the CPU it used; a thread asleep in a system
call reports little CPU; an idle or merely busy loop reports nothing."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.process.loop_watch import LoopWatch
from services.rpc import event_loop

Report = tuple[float, float | None, float, str]  # late, CPU, over how long, stack


def _watched(body: object, threshold_s: float = 0.05) -> tuple[LoopWatch, list[Report]]:
    reports: list[Report] = []

    async def main() -> None:
        watch.start(asyncio.get_running_loop())
        try:
            await body()  # type: ignore[operator]
            await asyncio.sleep(3 * watch.beat_s)  # a beat after it, on time
        finally:
            watch.stop()

    watch = LoopWatch(threshold_s, report=lambda *r: reports.append(r))
    asyncio.run(main())
    return watch, reports


def test_code_holding_the_loop_is_named_with_the_cpu_it_used() -> None:
    async def holds_the_loop() -> None:
        await asyncio.sleep(0.2)
        end = time.monotonic() + 0.6
        while time.monotonic() < end:  # computes on the loop's thread
            pass

    watch, reports = _watched(holds_the_loop, threshold_s=0.15)
    assert len(reports) == 1, reports  # one report for the one late beat
    late, cpu, over, stack = reports[0]
    assert 0.15 < late < 0.6
    assert over > 0  # counted from the watch's previous wake
    assert "holds_the_loop" in stack
    assert cpu is not None  # Linux: the thread's CPU clock
    assert cpu >= 0.5 * over  # the thread ran most of that time
    assert watch.blocks == 1
    assert 0.5 < watch.longest_s < 1.5  # the heartbeat saw the whole delay
    assert watch.latest_s < 0.5  # and the beats after it came on time


def test_a_thread_asleep_in_a_system_call_used_little_cpu() -> None:
    if not hasattr(time, "pthread_getcpuclockid"):
        pytest.skip("no per-thread CPU clock on this platform: no CPU figure to check")

    async def sleeps_on_the_loop() -> None:
        await asyncio.sleep(0.2)
        time.sleep(0.6)  # a blocking call, not computing

    _, reports = _watched(sleeps_on_the_loop, threshold_s=0.15)
    assert len(reports) == 1, reports
    _, cpu, over, stack = reports[0]
    assert "sleeps_on_the_loop" in stack
    assert cpu is not None and cpu < 0.5 * over


def test_a_loop_that_keeps_its_beats_reports_nothing() -> None:
    async def busy_but_yielding() -> None:
        end = time.monotonic() + 0.6
        while time.monotonic() < end:
            await asyncio.sleep(0.005)  # many short turns

    # a threshold no scheduler delay of a loaded test machine reaches
    watch, reports = _watched(busy_but_yielding, threshold_s=0.5)
    assert reports == [] and watch.blocks == 0
    assert watch.longest_s < 0.5


def test_run_with_a_watch_returns_the_coroutines_result() -> None:
    async def answer() -> int:
        await asyncio.sleep(0.01)
        return 42

    assert event_loop.run(answer(), "asyncio", watch_ms=50) == 42
    assert event_loop.run(answer(), "uvloop", watch_ms=50) == 42


def test_a_threshold_must_be_positive() -> None:
    with pytest.raises(ValueError):
        LoopWatch(0)
