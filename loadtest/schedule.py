"""Arrival schedules of the open-loop generator: when each request is due.

A schedule is a sorted array of offsets in seconds from the start of a run, fixed in
advance and independent of how fast the server answers (that is what makes the load
open-loop). ``fixed``: one request every ``1/rate`` s. ``poisson``: exponential gaps
of mean ``1/rate`` s from a seeded generator, so a run can be repeated exactly. A run
is bounded both ways: at most ``count`` requests and none due at or after ``duration_s``.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

Process = Literal["fixed", "poisson"]
PROCESSES: tuple[Process, ...] = ("fixed", "poisson")


def arrival_offsets(
    rate: float,
    duration_s: float,
    count: int | None = None,
    *,
    process: Process = "poisson",
    seed: int = 0,
) -> np.ndarray:
    """Offsets (s, float64, ascending) of the requests of one run; see the module doc."""
    if rate <= 0 or duration_s <= 0:
        raise ValueError(f"rate and duration must be > 0 (got {rate}, {duration_s})")
    if count is not None and count < 0:
        raise ValueError(f"count must be >= 0 (got {count})")
    expected = int(np.ceil(rate * duration_s))
    if process == "fixed":
        n = expected if count is None else min(count, expected)
        offsets = np.arange(n, dtype=np.float64) / rate
    elif process == "poisson":
        # Enough gaps that running out before duration_s is vanishingly unlikely (mean +
        # 8 standard deviations of a Poisson count); the first request is due at 0.
        n = int(expected + 8 * np.sqrt(expected) + 16)
        gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
        offsets = np.concatenate(([0.0], np.cumsum(gaps[:-1])))
    else:
        raise ValueError(f"unknown arrival process {process!r}; known: {PROCESSES}")
    offsets = offsets[offsets < duration_s]
    return offsets if count is None else offsets[:count]
