"""The catch-up's replay bound (services/generations/phase_catch_up.py ReplayBound): at
most ``factor`` times the write rate, ``floor`` entries/s at least, on a fake clock."""

from __future__ import annotations

import asyncio

import pytest

from services.generations.phase_catch_up import ReplayBound


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(round(seconds, 6))
        self.now += seconds


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_the_rate_is_factor_times_the_writes_and_the_floor_at_least() -> None:
    bound = ReplayBound(4.0, 50.0)
    assert bound.rate(25.0) == 100.0
    assert bound.rate(5.0) == 50.0  # the floor: a replay with few writes still moves
    assert bound.rate(0.0) == 50.0


def test_batches_are_spaced_to_the_rate_counting_the_replays_own_time(clock: Clock) -> None:
    bound = ReplayBound(4.0, 50.0, clock.monotonic, clock.sleep)

    async def go() -> None:
        await bound.after(10, write_rate=25.0)  # 100/s: 10 entries are 0.1 s
        clock.now += 0.05  # the next batch's replay took 0.05 s
        await bound.after(10, write_rate=25.0)  # so 0.05 s more
        clock.now += 0.5  # a slow batch: no wait, and no credit carried forward
        await bound.after(10, write_rate=25.0)
        await bound.after(10, write_rate=5.0)  # the floor, 50/s: 0.2 s

    asyncio.run(go())
    assert clock.slept == [0.1, 0.05, 0.2]
