"""How far a p99 ratio between two windows of one run can be trusted: a block bootstrap.

A p99 of 600 searches is their 6th slowest, so one slow second moves it. Searches are not
independent either: a slow spell of the machine slows a run of them together. So the
interval resamples *blocks* of consecutive searches (those that started in the same
``block_s`` seconds), with replacement, separately in each window, and takes the 2.5th
and 97.5th percentiles of the ratio of the resampled p99s (Künsch's moving-block
bootstrap, non-overlapping blocks). ``bench.rollout`` reports it beside
``p99_during_over_before``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _blocks(
    starts: Sequence[float], latencies: Sequence[float], block_s: float
) -> list[np.ndarray]:
    """The latencies grouped by the ``block_s``-second block their search started in."""
    if not starts:
        return []
    origin = min(starts)
    groups: dict[int, list[float]] = {}
    for start, latency in zip(starts, latencies, strict=True):
        groups.setdefault(int((start - origin) // block_s), []).append(latency)
    return [np.asarray(groups[k]) for k in sorted(groups)]


def _resampled_p99(blocks: list[np.ndarray], rng: np.random.Generator, reps: int) -> np.ndarray:
    out = np.empty(reps)
    for r in range(reps):
        picked = rng.integers(0, len(blocks), size=len(blocks))
        out[r] = np.percentile(np.concatenate([blocks[i] for i in picked]), 99)
    return out


def p99_ratio_interval(
    before: tuple[Sequence[float], Sequence[float]],
    during: tuple[Sequence[float], Sequence[float]],
    block_s: float = 2.0,
    reps: int = 2000,
    seed: int = 0,
) -> tuple[float, float] | None:
    """The 95 % interval of p99(during) ÷ p99(before); each window given as (start times,
    latencies) of its OK searches. None when a window has fewer than two blocks."""
    b, d = _blocks(*before, block_s), _blocks(*during, block_s)
    if len(b) < 2 or len(d) < 2:
        return None
    rng = np.random.default_rng(seed)
    ratios = _resampled_p99(d, rng, reps) / _resampled_p99(b, rng, reps)
    low, high = np.percentile(ratios, [2.5, 97.5])
    return float(low), float(high)
