"""The serving searches' latency, as the gateways report it and a rollout's builder reads
it to pace itself (:mod:`.pacing`; docs/generations.md "Pacing on the searches' p99").

Each gateway keeps the total latency of the searches it answered in the last
``window_s`` seconds (:class:`LatencyWindow`: one append per search, no I/O) and writes
its summary every second into the hash ``{gtr}:search-latency`` under a field of its own
(:func:`publish`; the key expires unless written again, so a stopped gateway drops out).
The builder reads every field (:func:`read`) and takes the slowest gateway's figure."""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from services.index.keys import SEARCH_LATENCY_KEY

WINDOW_S = 5.0  # the searches a summary covers (about 100 at 20 searches/s)
PUBLISH_S = 1.0  # a gateway writes its summary this often
KEY_TTL_S = 10  # ...and the key outlives its last write by this much
MAX_AGE_S = 3.0  # a summary older than this is a gateway that stopped reporting
MAX_KEPT = 20_000  # searches a window keeps at most (a burst does not grow it unbounded)


@dataclass(frozen=True)
class LatencySummary:
    """``searches`` answered in the window, and their latency percentiles (ms)."""

    searches: int
    p50_ms: float
    p99_ms: float
    at: float = 0.0  # unix time of the summary (set when published)

    def to_json(self) -> str:
        return json.dumps(
            {"n": self.searches, "p50": self.p50_ms, "p99": self.p99_ms, "at": self.at}
        )

    @classmethod
    def from_json(cls, raw: str | bytes) -> LatencySummary:
        d = json.loads(raw)
        return cls(int(d["n"]), float(d["p50"]), float(d["p99"]), float(d["at"]))


class LatencyWindow:
    """The total latency of the searches answered in the last ``window_s`` seconds."""

    def __init__(
        self, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.window_s = window_s
        self.clock = clock
        self._kept: deque[tuple[float, float]] = deque(maxlen=MAX_KEPT)

    def record(self, ms: float) -> None:
        self._kept.append((self.clock(), ms))

    def summary(self) -> LatencySummary:
        since = self.clock() - self.window_s
        while self._kept and self._kept[0][0] < since:
            self._kept.popleft()
        if not self._kept:
            return LatencySummary(0, 0.0, 0.0)
        ms = np.fromiter((m for _, m in self._kept), dtype=np.float64, count=len(self._kept))
        p50, p99 = np.percentile(ms, [50, 99])
        return LatencySummary(len(ms), round(float(p50), 2), round(float(p99), 2))


async def publish(client: Any, reporter: str, summary: LatencySummary) -> None:
    """Write ``reporter``'s summary (an async Redis client; the caller handles errors)."""
    stamped = LatencySummary(summary.searches, summary.p50_ms, summary.p99_ms, time.time())
    pipe = client.pipeline(transaction=False)
    pipe.hset(SEARCH_LATENCY_KEY, reporter, stamped.to_json())
    pipe.expire(SEARCH_LATENCY_KEY, KEY_TTL_S)
    await pipe.execute()


def read(client: Any, now: float | None = None) -> dict[str, LatencySummary]:
    """Every gateway's summary written within MAX_AGE_S (a sync Redis client)."""
    now = time.time() if now is None else now
    out: dict[str, LatencySummary] = {}
    raw: dict[Any, Any] = client.hgetall(SEARCH_LATENCY_KEY) or {}
    for field, value in raw.items():
        try:
            summary = LatencySummary.from_json(value)
        except (ValueError, KeyError, TypeError):
            continue  # not ours to judge: skipped
        if now - summary.at <= MAX_AGE_S:
            name = field.decode() if isinstance(field, bytes) else str(field)
            out[name] = summary
    return out
