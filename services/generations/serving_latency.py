"""The serving searches' latency, as the gateways report it and a rollout's builder reads
it to pace itself (:mod:`.pacing`; docs/generations.md "Pacing on the searches' p99").

Each gateway keeps the total latency of the searches it answered in the last
``baseline_s + baseline_lag_s`` seconds (:class:`LatencyWindow`: one append per search, no
I/O) and writes
its summary every second into the hash ``{gtr}:search-latency`` under a field of its own
(:func:`publish`; the key expires unless written again, so a stopped gateway drops out):
the last ``window_s`` (5 s: what a builder paces on, quick to follow a change) and the
``baseline_s`` before the last ``baseline_lag_s`` (30 s ending 15 s ago: the baseline a
builder takes before it loads the machine; the p99 of ~100 searches is about their slowest
one, which put one bench rollout's baseline at 20.7 ms while its 30 s before read 30.3 ms).
The lag keeps the rollout's own start out of its baseline: the CLI's first seconds (its
imports, connections and claim, before the builder reads the baseline; 2-s p99s of 58-77
ms) put a bench rollout's baseline at 41.3 ms on a stack whose 90 s before read 27.1 ms (a
1.1-CPU CFS quota, 2026-12-03), and its target, 1.2 times that, let the searches reach
2.08x. The builder reads every field
(:func:`read`) and takes the slowest gateway's figure."""

from __future__ import annotations

import dataclasses
import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from services.index.keys import SEARCH_LATENCY_KEY

WINDOW_S = 5.0  # the searches a summary covers (about 100 at 20 searches/s)
BASELINE_S = 30.0  # ...and its baseline figures (about 600)
BASELINE_LAG_S = 15.0  # ...which end this long before the summary (the module says why)
PUBLISH_S = 1.0  # a gateway writes its summary this often
KEY_TTL_S = 10  # ...and the key outlives its last write by this much
MAX_AGE_S = 3.0  # a summary older than this is a gateway that stopped reporting
# searches a window keeps at most (a burst does not grow it unbounded): 45 s of up to ~670
# searches/s, as 20,000 were 30 s of them before the lag. Past ~2,000/s a gateway keeps less
# than the lag, its baseline window is empty, and the builder paces on the 5-s p99
# (pacing.slowest_baseline_p99).
MAX_KEPT = 30_000


@dataclass(frozen=True)
class LatencySummary:
    """``searches`` answered in the window, and their latency percentiles (ms); over the
    longer baseline window, ``baseline_searches`` and their ``baseline_p99_ms`` (0 from a
    gateway that reports none)."""

    searches: int
    p50_ms: float
    p99_ms: float
    at: float = 0.0  # unix time of the summary (set when published)
    baseline_searches: int = 0
    baseline_p99_ms: float = 0.0

    def to_json(self) -> str:
        return json.dumps(
            {
                "n": self.searches,
                "p50": self.p50_ms,
                "p99": self.p99_ms,
                "at": self.at,
                "bn": self.baseline_searches,
                "bp99": self.baseline_p99_ms,
            }
        )

    @classmethod
    def from_json(cls, raw: str | bytes) -> LatencySummary:
        d = json.loads(raw)
        return cls(
            int(d["n"]),
            float(d["p50"]),
            float(d["p99"]),
            float(d["at"]),
            int(d.get("bn", 0)),
            float(d.get("bp99", 0.0)),
        )


class LatencyWindow:
    """The total latency of the searches answered in the last ``window_s`` seconds, and
    the p99 of the ``baseline_s`` that ended ``baseline_lag_s`` ago."""

    def __init__(
        self,
        window_s: float = WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
        baseline_s: float = BASELINE_S,
        baseline_lag_s: float = BASELINE_LAG_S,
    ) -> None:
        self.window_s = window_s
        self.baseline_s = baseline_s
        self.baseline_lag_s = baseline_lag_s
        self.kept_s = max(baseline_s + baseline_lag_s, window_s)
        self.clock = clock
        # when each search ended (ascending) and its latency: two deques, so that a summary
        # reads each into numpy at C speed (it runs on the gateway's event loop once a
        # second; at 20,000 searches kept: 1.3-1.9 ms, against 2.5-3.1 ms from one deque of
        # pairs, timed alone; 2026-12-03, alone: 2.2 ms at 20,000, 3.7 ms at MAX_KEPT)
        self._at: deque[float] = deque(maxlen=MAX_KEPT)
        self._ms: deque[float] = deque(maxlen=MAX_KEPT)

    def record(self, ms: float) -> None:
        self._at.append(self.clock())
        self._ms.append(ms)

    def summary(self) -> LatencySummary:
        now = self.clock()
        while self._at and self._at[0] < now - self.kept_s:
            self._at.popleft()
            self._ms.popleft()
        if not self._at:
            return LatencySummary(0, 0.0, 0.0)
        at = np.fromiter(self._at, dtype=np.float64, count=len(self._at))
        ms = np.fromiter(self._ms, dtype=np.float64, count=len(self._ms))
        recent = ms[int(at.searchsorted(now - self.window_s)) :]
        end = now - self.baseline_lag_s
        first = int(at.searchsorted(end - self.baseline_s))
        base = ms[first : int(at.searchsorted(end, side="right"))]
        baseline_p99 = round(float(np.percentile(base, 99)), 2) if len(base) else 0.0
        if not len(recent):
            return LatencySummary(0, 0.0, 0.0, 0.0, len(base), baseline_p99)
        p50, p99 = np.percentile(recent, [50, 99])
        return LatencySummary(
            len(recent), round(float(p50), 2), round(float(p99), 2), 0.0, len(base), baseline_p99
        )


async def publish(client: Any, reporter: str, summary: LatencySummary) -> None:
    """Write ``reporter``'s summary (an async Redis client; the caller handles errors)."""
    stamped = dataclasses.replace(summary, at=time.time())
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
