"""The latency budget a load test checks against (``--slo-ms`` overrides it).

The end-to-end Search SLO of the encoder size, with or without rerank as the requests
ask, from the service's one table (``services/common/slo.py``, which the Prometheus rules
and alerts are generated from). The default model, MiniLM, is held to GTR-base's
objectives (its encoder profile reuses GTR-base's SLO).
"""

from __future__ import annotations

from services.common.slo import SLOS, slo_for

SIZES = (*SLOS, "minilm")
MINILM_SLO_SIZE = "base"


def default_slo_ms(size: str, rerank: bool = False) -> float:
    """The Search budget of ``size`` in ms (NotFound names the known sizes)."""
    slo = slo_for(MINILM_SLO_SIZE if size == "minilm" else size)
    return slo.search_budget_s(rerank) * 1000.0
