"""The latency budget a load test checks against (``--slo-ms`` overrides it).

Without rerank: the end-to-end Search SLO of the encoder size, the thresholds of
``deploy/prometheus/rules.yml`` (``gtr:search_slo_threshold_seconds``; MiniLM, the default
model, uses GTR-base's). With rerank there is no published end-to-end SLO: the budget is
the Search SLO plus the measured cost of the rerank depth asked for (the gateway's depth
table, ``services/rerank/depths.py``), and a rerank run without a depth in that table
must name its budget with ``--slo-ms``.
"""

from __future__ import annotations

from services.rerank.depths import DEFAULT_DEPTH_TABLE

SEARCH_SLO_MS = {"base": 50.0, "large": 75.0, "xl": 150.0, "xxl": 500.0, "minilm": 50.0}


def default_slo_ms(size: str, rerank: bool = False, rerank_depth: int = 0) -> float:
    if size not in SEARCH_SLO_MS:
        raise ValueError(f"unknown encoder size {size!r}; known: {sorted(SEARCH_SLO_MS)}")
    if not rerank:
        return SEARCH_SLO_MS[size]
    if rerank_depth not in DEFAULT_DEPTH_TABLE:
        raise ValueError(
            f"rerank depth {rerank_depth} has no measured cost "
            f"(table: {sorted(DEFAULT_DEPTH_TABLE)}); pass --rerank-depth from it or --slo-ms"
        )
    return SEARCH_SLO_MS[size] + DEFAULT_DEPTH_TABLE[rerank_depth]
