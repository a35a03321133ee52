"""The block bootstrap of a p99 ratio (bench/p99_interval.py): it covers the ratio of two
windows drawn alike, excludes 1 when one window is twice as slow, and widens when slow
searches come in spells rather than alone."""

from __future__ import annotations

import numpy as np

from bench.p99_interval import p99_ratio_interval


def _window(rng: np.random.Generator, n: int, scale: float) -> tuple[list[float], list[float]]:
    starts = list(np.arange(n) / 20.0)  # 20 searches/s
    return starts, list(scale * rng.lognormal(np.log(0.012), 0.4, size=n))


def test_alike_windows_cover_one() -> None:
    rng = np.random.default_rng(1)
    low, high = p99_ratio_interval(_window(rng, 1800, 1.0), _window(rng, 2000, 1.0)) or (0, 0)
    assert low < 1.0 < high


def test_a_window_twice_as_slow_excludes_one() -> None:
    rng = np.random.default_rng(2)
    low, high = p99_ratio_interval(_window(rng, 1800, 1.0), _window(rng, 2000, 2.0)) or (0, 0)
    assert 1.0 < low < 2.0 < high


def test_spells_widen_the_interval() -> None:
    rng = np.random.default_rng(3)
    starts, lat = _window(rng, 1800, 1.0)
    alone = list(lat)
    spells = list(lat)
    for i in rng.choice(1800, size=18, replace=False):
        alone[i] *= 3  # 18 slow searches, each on its own
    for block in rng.choice(900 // 40, size=1, replace=False):
        for i in range(block * 40, block * 40 + 18):
            spells[i] *= 3  # the same 18, in one 2-s spell
    during = _window(rng, 2000, 1.0)
    a = p99_ratio_interval((starts, alone), during) or (0, 0)
    s = p99_ratio_interval((starts, spells), during) or (0, 0)
    assert s[1] - s[0] > a[1] - a[0]


def test_too_few_blocks_has_no_interval() -> None:
    assert p99_ratio_interval(([0.0, 0.1], [0.01, 0.02]), ([0.0], [0.01])) is None
