"""The time a search's stages get: what the index search leaves for what follows it, what an
automatic-depth rerank leaves for the answer, and the bounded wait every stage goes through.

No grpc here (see :mod:`services.gateway.pipeline`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TypeVar

from services.common.deadline import Deadline
from services.common.errors import DeadlineExceeded

# The deadline of a request that brings none (GatewaySettings.default_timeout_s).
DEFAULT_TIMEOUT_S = 10.0

T = TypeVar("T")

# Kept from the index search for what follows it (document fetch, rerank, answer): a
# share of the request's whole budget, taken at its start. The router keeps a share of
# what is left when it is called, which shrinks with the time the encoder took: with
# both replicas of a shard hung, the router answered concurrent 1 s searches with 5 to
# 90 ms left, too little for the rest, and they ended DEADLINE_EXCEEDED, not partial.
AFTER_SEARCH_SHARE = 0.1
AFTER_SEARCH_MIN_S = 0.005


# A rerank whose depth the gateway chose (depth 0) is planned from the measured depth
# table, which a machine busier than the one it was measured on overruns: on the 2-core
# machine at load 10, depth 100 took 22 s where the table says 5.3 s, and the README's
# `search "parse command line arguments" -k 10 --rerank` (a 10 s deadline) ended
# DEADLINE_EXCEEDED. Such a rerank gets the time left less this reserve for the answer;
# when it does not finish in it, the hits keep their first-stage order and the response
# says so (rerank_skipped), as when no measured depth fits. A named depth keeps the whole
# deadline and fails with it.
RERANK_RESERVE_SHARE = 0.05
RERANK_RESERVE_MIN_S = 0.02


def rerank_deadline(deadline: Deadline) -> Deadline:
    """``deadline`` less the reserve an automatic-depth rerank leaves for the answer."""
    left = deadline.remaining()
    if deadline.at is None or left is None:
        return deadline
    return Deadline(deadline.at - max(RERANK_RESERVE_MIN_S, left * RERANK_RESERVE_SHARE))


def search_deadline(deadline: Deadline, budget: float) -> Deadline:
    """``deadline`` less the time kept for what follows the index search."""
    if deadline.at is None:
        return deadline
    return Deadline(deadline.at - max(AFTER_SEARCH_MIN_S, budget * AFTER_SEARCH_SHARE))


async def bounded(step: Awaitable[T], deadline: Deadline, stage: str) -> T:
    """Await ``step`` for at most what is left of ``deadline`` (DeadlineExceeded after)."""
    try:
        async with asyncio.timeout(deadline.remaining()):
            return await step
    except TimeoutError:
        raise DeadlineExceeded(f"deadline exceeded during {stage}") from None


def ms_since(since: float) -> float:
    """Milliseconds from ``since`` (a ``time.perf_counter()`` reading) to now."""
    return (time.perf_counter() - since) * 1000.0
