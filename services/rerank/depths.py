"""Rerank depth by latency budget, from the table ``bench/rerank.py`` measures.

The table maps a rerank depth (candidates per query) to the measured milliseconds per
query at that depth (``bench/results/rerank_depths.json``:
``{"ms_per_query_at_depth": {"10": 510.1, ...}, "source": {...}}``). This module is the
only owner of the table's format, its default and the choice of a depth: the gateway
(``--rerank-depth-table``) and the bench both use it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

from services.common.errors import InvalidArgument, NotFound

# The table used when none is configured: bench/results/rerank_depths.json as measured
# on 2 CPU cores with the default backbone (all-MiniLM-L6-v2, CELI, batch 16, max_len 256;
# see docs/rerank.md). Conservative on a GPU, where every depth costs far less.
DEFAULT_DEPTH_TABLE: Mapping[int, float] = MappingProxyType(
    {10: 510.1, 20: 1025.6, 50: 2854.1, 100: 5348.5}
)


def load_depth_table(path: Path) -> dict[int, float]:
    """``{depth: ms}`` from a bench file (or a bare ``{"10": 510.1, ...}`` mapping).

    NotFound when the file does not exist; InvalidArgument when it cannot be read or is
    not such a table. Never falls back to a default: a table someone configured and
    that cannot be used is an error.
    """
    path = Path(path)
    if not path.exists():
        raise NotFound(f"{path}: no rerank depth table (run bench/rerank.py)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise InvalidArgument(f"{path}: unreadable rerank depth table ({exc})") from None
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


def depth_table(path: str | Path | None) -> dict[int, float]:
    """The table at ``path`` (errors as :func:`load_depth_table`), or the default for None."""
    return dict(DEFAULT_DEPTH_TABLE) if path is None else load_depth_table(Path(path))


def depth_for_budget(budget_ms: float, table: Mapping[int, float]) -> int:
    """The largest measured depth whose cost fits ``budget_ms``; 0 when none does.

    0 means "do not rerank": even the smallest measured depth would break the budget,
    and the caller should answer with the first stage's order instead.
    """
    fitting = [depth for depth, ms in table.items() if ms <= budget_ms]
    return max(fitting) if fitting else 0
