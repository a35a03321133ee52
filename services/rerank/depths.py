"""Rerank depth by latency budget, from the table ``bench/rerank.py`` measures.

The table maps a rerank depth (candidates per query) to the measured milliseconds per
query at that depth (``bench/results/rerank_depths.json``:
``{"ms_per_query_at_depth": {"10": 510.1, ...}, "source": {...}}``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from services.common.errors import InvalidArgument, NotFound


def load_depth_table(path: Path) -> dict[int, float]:
    """``{depth: ms}`` from a bench file (or a bare ``{"10": 510.1, ...}`` mapping)."""
    path = Path(path)
    if not path.exists():
        raise NotFound(f"{path}: no rerank depth table (run bench/rerank.py)")
    raw = json.loads(path.read_text(encoding="utf-8"))
    table = raw.get("ms_per_query_at_depth", raw) if isinstance(raw, dict) else None
    if not isinstance(table, dict) or not table:
        raise InvalidArgument(f"{path}: expected {{depth: ms}} under 'ms_per_query_at_depth'")
    try:
        parsed = {int(k): float(v) for k, v in table.items()}
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"{path}: depths must be integers, costs numbers") from exc
    if any(d < 1 or ms < 0 for d, ms in parsed.items()):
        raise InvalidArgument(f"{path}: depths must be >= 1 and costs >= 0")
    return parsed


def depth_for_budget(budget_ms: float, table: Mapping[int, float]) -> int:
    """The largest measured depth whose cost fits ``budget_ms``; 0 when none does.

    0 means "do not rerank": even the smallest measured depth would break the budget,
    and the caller should answer with the first stage's order instead.
    """
    fitting = [depth for depth, ms in table.items() if ms <= budget_ms]
    return max(fitting) if fitting else 0
