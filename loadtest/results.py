"""A run's records → the figures it reports: rates, percentiles, errors, SLO attainment.

Percentiles are of the latency from the *scheduled* time of the requests that succeeded,
taken from every recorded value (numpy, ``method="higher"``: an observed latency, never
one interpolated below it). SLO attainment is over *every* scheduled request: a failed
or unsent one is a miss. ``generator_lag_*`` is how late the sender itself started
calls; when its p99 is over ``lag_limit_ms`` (default: a quarter of the budget), or it
sent at under 95 % of the scheduled rate, the run says ``generator_behind`` and the
figures describe the generator, not the server.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import numpy as np

from loadtest.runner import NOT_SENT, Records

PERCENTILES = {"p50": 50.0, "p90": 90.0, "p99": 99.0, "p99_9": 99.9}
# Default lag limit: a quarter of the latency budget. A lag is charged to the latencies
# (they count from the schedule), so it can only make a run look worse, never better;
# past this share the verdict on the SLO would be the generator's rather than the server's.
LAG_LIMIT_SHARE = 0.25
ATTAINMENT_GOAL = 0.99


def _pct(values: np.ndarray, q: float) -> float:
    if values.size == 0:
        return float("nan")
    return float(np.percentile(values, q, method="higher"))


def summarize(records: Records, slo_ms: float, lag_limit_ms: float | None = None) -> dict[str, Any]:
    """The figures of one run (a flat dict: the JSON line and the table); the lag limit
    defaults to a quarter of the budget (``LAG_LIMIT_SHARE``)."""
    if lag_limit_ms is None:
        lag_limit_ms = LAG_LIMIT_SHARE * slo_ms
    cfg = records.config
    n = len(records.codes)
    ok = np.array([c == "OK" for c in records.codes], dtype=bool)
    was_sent = ~np.isnan(records.sent)
    latency_ms = records.latency_s * 1e3
    service_ms = records.service_s * 1e3
    lag_ms = records.lag_s[was_sent] * 1e3
    ok_latency = latency_ms[ok]
    last_done = float(np.nanmax(records.done)) if was_sent.any() else records.start
    window = max(last_done - records.start, 1e-9)
    span = float(records.due[-1] - records.due[0]) if n > 1 else 0.0
    within = int(np.count_nonzero(ok_latency <= slo_ms))
    errors = Counter(c for c in records.codes if c != "OK")
    by_op = Counter(records.ops)
    out: dict[str, Any] = {
        "offered_rate": cfg.rate,
        "process": cfg.process,
        "requests": n,
        "ops": dict(by_op),
        "scheduled_rate": (n - 1) / span if span > 0 else float("nan"),
        "sent": int(np.count_nonzero(was_sent)),
        "ok": int(np.count_nonzero(ok)),
        "achieved_rate": float(np.count_nonzero(ok)) / window,
    }
    for name, q in PERCENTILES.items():
        out[f"{name}_ms"] = _pct(ok_latency, q)
    out |= {
        "max_ms": float(ok_latency.max()) if ok_latency.size else float("nan"),
        "service_p50_ms": _pct(service_ms[ok], 50.0),
        "service_p99_ms": _pct(service_ms[ok], 99.0),
        "errors": dict(sorted(errors.items())),
        "error_fraction": (n - int(np.count_nonzero(ok))) / n if n else 0.0,
        "partial": int(np.count_nonzero(records.partial)),
        "partial_fraction": float(np.count_nonzero(records.partial)) / max(1, int(ok.sum())),
        "rerank_skipped": int(np.count_nonzero(records.rerank_skipped)),
        "slo_ms": slo_ms,
        "slo_attainment": within / n if n else float("nan"),
        "generator_lag_p50_ms": _pct(lag_ms, 50.0),
        "generator_lag_p99_ms": _pct(lag_ms, 99.0),
        "generator_lag_max_ms": float(lag_ms.max()) if lag_ms.size else float("nan"),
        "generator_lag_limit_ms": lag_limit_ms,
        "not_sent": errors.get(NOT_SENT, 0),
    }
    sent_times = np.sort(records.sent[was_sent])
    sent_span = float(sent_times[-1] - sent_times[0]) if sent_times.size > 1 else 0.0
    out["sent_rate"] = (sent_times.size - 1) / sent_span if sent_span > 0 else float("nan")
    out["generator_behind"] = bool(
        out["not_sent"] > 0
        or (lag_ms.size > 0 and out["generator_lag_p99_ms"] > lag_limit_ms)
        or (sent_span > 0 and span > 0 and out["sent_rate"] < 0.95 * out["scheduled_rate"])
    )
    out["slo_met"] = bool(
        out["ok"] > 0 and out["p99_ms"] <= slo_ms and out["slo_attainment"] >= ATTAINMENT_GOAL
    )
    return out


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 100 else f"{value:,.1f}"
    return str(value)


def table(summary: dict[str, Any]) -> str:
    """The figures as an aligned two-column table."""
    return "\n".join(f"{key:>22}  {_fmt(value)}" for key, value in summary.items())


def json_line(summary: dict[str, Any]) -> str:
    def clean(value: Any) -> Any:
        if isinstance(value, float):
            return None if value != value else round(value, 4)
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    return json.dumps(clean(summary), sort_keys=False)
