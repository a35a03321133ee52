"""Closed-loop driving: ``concurrency`` workers, each sending its next call when the last
one came back. That measures capacity (the most a fixed number of callers get through),
not latency under a given arrival rate: while the server stalls a closed-loop client
stops sending, so the stall shows up in one request's latency instead of in every
request that would have arrived meanwhile (coordinated omission). The open-loop
generator (:mod:`loadtest.runner`) is the one whose latencies to quote; this one is for
throughput ratios (:mod:`loadtest.bottleneck`) and the overhead baseline.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from services.common.errors import RetrievalError
from services.rpc.status import status_of


@dataclass
class ClosedLoopResult:
    elapsed_s: float
    latencies_s: list[float] = field(default_factory=list)  # of the calls that succeeded
    codes: Counter[str] = field(default_factory=Counter)

    @property
    def throughput(self) -> float:
        """Successful calls per second."""
        return self.codes["OK"] / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def errors(self) -> dict[str, int]:
        return {code: n for code, n in self.codes.items() if code != "OK"}

    def percentile_ms(self, q: float) -> float:
        if not self.latencies_s:
            return float("nan")
        return float(np.percentile(np.asarray(self.latencies_s) * 1e3, q, method="higher"))


async def closed_loop(
    call: Callable[[int], Awaitable[Any]],
    concurrency: int,
    seconds: float,
    max_calls: int | None = None,
) -> ClosedLoopResult:
    """Run ``call(i)`` (i = 0, 1, 2, ... across workers) from ``concurrency`` workers for
    ``seconds`` or ``max_calls`` calls; errors are counted by gRPC status code name."""
    result = ClosedLoopResult(elapsed_s=0.0)
    issued = 0
    stop_at = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal issued
        while time.perf_counter() < stop_at and (max_calls is None or issued < max_calls):
            i = issued
            issued += 1
            began = time.perf_counter()
            try:
                await call(i)
            except grpc.aio.AioRpcError as exc:
                result.codes[exc.code().name] += 1
                continue
            except RetrievalError as exc:  # a client of ours that maps codes to errors
                result.codes[status_of(exc).name] += 1
                continue
            result.latencies_s.append(time.perf_counter() - began)
            result.codes["OK"] += 1

    began = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    result.elapsed_s = time.perf_counter() - began
    return result
