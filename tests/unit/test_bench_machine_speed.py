"""bench/machine_speed.py: the machine's own pace, as a bench records it beside its result."""

from __future__ import annotations

import math

from bench import machine_speed


def test_the_speed_is_the_fastest_timing_of_a_fixed_piece_of_work() -> None:
    one = machine_speed.speed_ms(repeats=1)
    best = machine_speed.speed_ms(repeats=3)
    assert math.isfinite(one) and one > 0
    assert math.isfinite(best) and best > 0
    # less of the work is not slower than all of it (twice, for a busy moment)
    assert machine_speed.speed_ms(repeats=3, size=1 << 10) <= 2 * best
