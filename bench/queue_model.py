"""What queueing alone allows: the highest Poisson rate an M/G/c queue holds within a
latency SLO, for service times measured on this machine (issue #34 point 3).

The model is the best any design could do with that work per search and ``c`` cores:
arrivals are Poisson, each request is served whole by one of ``c`` servers in arrival
order, and nothing else costs time (no wake-up, no hop, no lock, no other process). A
real server's SLO rate below the model's is what its runtime and scheduling lose; the
model's rate below a goal says the goal needs less work per search, not a better design.

The simulation uses common random numbers: the same unit-rate arrivals scaled by the
rate, and the same draws of service times, at every rate, so the p99 grows with the rate
and the search for the edge is a bisection.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

ATTAINMENT = 0.99  # the share within the SLO a rate must reach (loadtest's goal)


@dataclass(frozen=True)
class ModelRate:
    """The model's answer: the highest rate, its p99, and the ceiling (c ÷ mean service)."""

    best_rate: float
    p99_ms: float
    ceiling: float

    @property
    def over_ceiling(self) -> float:
        return self.best_rate / self.ceiling


def response_times(
    rate: float, servers: int, service_s: np.ndarray, unit_gaps: np.ndarray
) -> np.ndarray:
    """Each request's wait plus service (s) in an FCFS queue of ``servers`` servers."""
    arrivals = np.cumsum(unit_gaps / rate)
    free = [0.0] * servers
    out = np.empty(len(arrivals))
    for i, (arrival, service) in enumerate(zip(arrivals, service_s, strict=True)):
        start = max(arrival, heapq.heappop(free))
        heapq.heappush(free, start + service)
        out[i] = start + service - arrival
    return out


def best_rate(
    service_ms: Sequence[float],
    servers: int,
    slo_ms: float,
    requests: int = 40_000,
    seed: int = 0,
    tolerance: float = 0.005,
) -> ModelRate:
    """The highest rate whose p99 response is within ``slo_ms`` (so ≥ 99 % within it),
    service times drawn with replacement from ``service_ms``."""
    measured = np.asarray(service_ms, dtype=np.float64) / 1e3
    if measured.size == 0 or servers < 1:
        raise ValueError("need service times and at least one server")
    rng = np.random.default_rng(seed)
    service = rng.choice(measured, size=requests, replace=True)
    gaps = rng.exponential(1.0, size=requests)
    ceiling = servers / float(measured.mean())
    slo_s = slo_ms / 1e3

    def p99(rate: float) -> float:
        return float(np.percentile(response_times(rate, servers, service, gaps), 99))

    low, high = ceiling * 1e-3, ceiling
    alone = p99(low)
    if alone > slo_s:  # the service alone breaks the SLO
        return ModelRate(0.0, 1e3 * alone, ceiling)
    while high - low > tolerance * ceiling:
        mid = (low + high) / 2
        low, high = (mid, high) if p99(mid) <= slo_s else (low, mid)
    return ModelRate(low, 1e3 * p99(low), ceiling)
