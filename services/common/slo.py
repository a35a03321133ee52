"""The latency SLOs of the service, in one table.

Everything that names an SLO threshold reads it from here: the gateway's defaults (and
the ``gtr_slo_seconds`` gauge it exports), the Prometheus rules
(``scripts/gen_rules.py`` writes ``deploy/prometheus/rules.yml`` from this module; a test
fails when the checked-in file differs) and the Helm chart's per-size profiles (a test
compares ``encoder.profiles`` of ``values.yaml`` with :data:`SLOS`).

Each threshold is a bucket edge of the latency histograms
(:data:`services.rpc.metrics.LATENCY_BUCKETS` is built to contain them), so the
SLI is an exact bucket count, never an interpolated quantile.

The SLIs count what a user feels:

- **encode**: an encode call of the gateway's query encoder (one per Search or
  BatchSearch request) is good when it succeeds within the size's threshold; a call
  that fails or times out is a miss (``gtr_encode_calls_total`` counts every call,
  ``gtr_encode_seconds`` the successful ones).
- **search**: a ``Search`` request is good when it answers OK within its budget (with
  or without rerank, as the request asked); one that fails, times out, is refused by
  admission control or cancelled is a miss. Requests refused for the caller's own
  mistake (:data:`CLIENT_ERROR_CODES`) are not counted at all. ``BatchSearch`` is not
  held to these budgets (its time grows with the batch); its failures count in the
  server error ratio alerts.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.errors import NotFound


@dataclass(frozen=True)
class SizeSlo:
    """Latency objectives of one encoder size, in seconds."""

    size: str
    encode_s: float  # one query encode (GTR paper, batch 1, 128 tokens)
    search_s: float  # end-to-end Search: encode + fan-out + fetch
    search_rerank_s: float  # the same with the CELI rerank the request asked for

    def search_budget_s(self, rerank: bool) -> float:
        return self.search_rerank_s if rerank else self.search_s


# The encode figures are the GTR paper's latencies (Ni et al. 2021, batch 1, 128 tokens).
# Search without rerank: the encode plus ~35-55 ms for fan-out, merge and the document
# fetch. With rerank: 200 ms more for CELI at the depth the gateway picks (it fits the
# rerank into 60 % of what is left of the deadline, services/rerank/depths.py), rounded
# up to a bucket edge.
SLOS: dict[str, SizeSlo] = {
    "base": SizeSlo("base", encode_s=0.017, search_s=0.05, search_rerank_s=0.25),
    "large": SizeSlo("large", encode_s=0.034, search_s=0.075, search_rerank_s=0.3),
    "xl": SizeSlo("xl", encode_s=0.096, search_s=0.15, search_rerank_s=0.4),
    "xxl": SizeSlo("xxl", encode_s=0.349, search_s=0.5, search_rerank_s=0.75),
}

# Share of valid events that must be good, over the SLO period.
OBJECTIVE = 0.99
PERIOD_DAYS = 30


@dataclass(frozen=True)
class BurnRateAlert:
    """One multiwindow burn-rate condition (Google SRE workbook, ch. 5, table 5-8)."""

    long_window: str
    short_window: str
    burn_rate: float
    severity: str  # critical pages, warning opens a ticket
    budget_spent: str  # what firing means, for the alert's description


BURN_RATE_ALERTS: tuple[BurnRateAlert, ...] = (
    BurnRateAlert("1h", "5m", 14.4, "critical", "2 % of the 30-day error budget in 1 hour"),
    BurnRateAlert("6h", "30m", 6.0, "critical", "5 % of the 30-day error budget in 6 hours"),
    BurnRateAlert("1d", "2h", 3.0, "warning", "10 % of the 30-day error budget in 1 day"),
    BurnRateAlert("3d", "6h", 1.0, "warning", "10 % of the 30-day error budget in 3 days"),
)

# Status codes that are the caller's mistake: neither good nor bad for an SLO.
# Everything else that is not OK is a miss: DEADLINE_EXCEEDED and CANCELLED (a client
# whose deadline ran out), RESOURCE_EXHAUSTED (refused under load), UNAVAILABLE, ...
CLIENT_ERROR_CODES: tuple[str, ...] = (
    "INVALID_ARGUMENT",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "FAILED_PRECONDITION",
    "OUT_OF_RANGE",
    "UNAUTHENTICATED",
    "PERMISSION_DENIED",
)
# Codes that are the service's failures (the server error ratio alerts).
SERVER_ERROR_CODES: tuple[str, ...] = (
    "UNKNOWN",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "DEADLINE_EXCEEDED",
    "RESOURCE_EXHAUSTED",
)


def slo_for(size: str) -> SizeSlo:
    """The objectives of encoder size ``size``; NotFound names the known sizes."""
    try:
        return SLOS[size]
    except KeyError:
        raise NotFound(f"no SLO for encoder size {size!r}; known: {sorted(SLOS)}") from None


def thresholds() -> tuple[float, ...]:
    """Every threshold of the table, sorted (each must be a histogram bucket edge)."""
    values = {v for s in SLOS.values() for v in (s.encode_s, s.search_s, s.search_rerank_s)}
    return tuple(sorted(values))
