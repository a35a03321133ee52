"""How fast this machine's CPU is right now: a fixed piece of work, timed.

The same bench on the same code read 1.87-1.94x in one period of this VM and 0.97-1.00x a
few hours later (docs/generations.md, "Each change against the base"), no steal counted
in the later one (the earlier predates the count); the searches themselves were a third
slower before any rollout in the first. A
figure for the machine's own pace beside a bench's result says which period a run came
from. :func:`speed_ms` times a fixed mix (a Python loop, float32 arithmetic over 4 MB, both
on one thread) on the calling thread, the best of ``repeats`` so that a busy moment does not
count; a run records it before its load starts and after it ends
(``bench.rollout_rounds``'s ``machine_speed_ms``).
"""

from __future__ import annotations

import functools
import time

import numpy as np


@functools.cache
def _vector(size: int) -> np.ndarray:
    """The floats the work runs over, made once per size (not at import)."""
    return np.random.default_rng(0).standard_normal(size, dtype=np.float32)


def _work(size: int) -> float:
    total = 0
    for i in range(60_000):  # interpreter speed: the gateway's and the shards' Python
        total += i * i % 7
    a = _vector(size)  # elementwise, one thread (no BLAS thread pool): SIMD and memory
    return float((a * a + a).sum()) + total


def speed_ms(repeats: int = 7, size: int = 1 << 20) -> float:
    """The fastest of ``repeats`` timings of the fixed work (ms; lower is faster)."""
    best = float("inf")
    _vector(size)  # made before the timings
    for _ in range(repeats):
        began = time.perf_counter()
        _work(size)
        best = min(best, time.perf_counter() - began)
    return round(1e3 * best, 2)
