"""Ranking measures by ``ir-measures`` (pytrec_eval underneath), never by hand.

A *run* is ``{query id: [doc id, ...]}`` in rank order (what a search returns); it is
scored with descending scores by rank, so ties cannot reorder it. Qrels are
``{query id: {doc id: relevance}}``. Means are over the queries of the qrels that the run
answered; a query the run left out scores 0 (``fill_missing``) so that systems compared on
the same queries stay comparable.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from services.common.errors import InvalidArgument

Run = Mapping[str, Sequence[str]]
Qrels = Mapping[str, Mapping[str, int]]

# name in reports → the ir-measures measure
MEASURE_NAMES: dict[str, str] = {
    "ndcg_at_10": "nDCG@10",
    "recall_at_100": "R@100",
    "mrr_at_10": "RR@10",
}


@dataclass(frozen=True)
class Scores:
    """Per-query values of every measure, and their means over the same queries."""

    per_query: dict[str, dict[str, float]]  # measure name → query id → value
    queries: tuple[str, ...]

    def mean(self, name: str) -> float:
        values = self.per_query[name]
        return float(np.mean([values[q] for q in self.queries])) if self.queries else 0.0

    def means(self) -> dict[str, float]:
        return {name: self.mean(name) for name in self.per_query}

    def values(self, name: str, queries: Sequence[str] | None = None) -> list[float]:
        return [self.per_query[name][q] for q in (queries or self.queries)]


def _measures() -> dict[str, Any]:
    import ir_measures

    return {name: ir_measures.parse_measure(text) for name, text in MEASURE_NAMES.items()}


def score(run: Run, qrels: Qrels, queries: Sequence[str] | None = None) -> Scores:
    """Every measure of :data:`MEASURE_NAMES` for each query of ``queries``.

    ``queries`` (default: every query of ``qrels`` with a relevant document) are the ones
    averaged; a query the run has no answer for scores 0.
    """
    import ir_measures

    qids = tuple(
        queries
        if queries is not None
        else sorted(q for q, rels in qrels.items() if any(r > 0 for r in rels.values()))
    )
    missing = [q for q in qids if q not in qrels]
    if missing:
        raise InvalidArgument(f"{len(missing)} queries have no qrels, e.g. {missing[0]!r}")
    measures = _measures()
    by_measure = {m: name for name, m in measures.items()}
    per_query: dict[str, dict[str, float]] = {name: dict.fromkeys(qids, 0.0) for name in measures}
    sub_qrels = {q: {d: int(r) for d, r in qrels[q].items()} for q in qids}
    sub_run = {
        q: {d: float(len(run[q]) - i) for i, d in enumerate(dict.fromkeys(run[q]))}
        for q in qids
        if run.get(q)
    }
    for metric in ir_measures.iter_calc(list(measures.values()), sub_qrels, sub_run):
        per_query[by_measure[metric.measure]][metric.query_id] = float(metric.value)
    return Scores(per_query, qids)


def paired_comparison(
    base: Sequence[float], system: Sequence[float], resamples: int = 10_000, seed: int = 0
) -> dict[str, Any]:
    """Per-query comparison of a system with its baseline on the same queries.

    ``wins``/``losses``/``ties`` count queries; ``mean_diff`` is the mean per-query
    difference; ``ci95`` its 95 % bootstrap interval (``scipy.stats.bootstrap``,
    percentile method, queries resampled with replacement, fixed ``seed``); ``p_value``
    the paired t-test (``scipy.stats.ttest_rel``). An interval that contains 0 means the
    gain is within what the choice of queries can move.
    """
    from scipy import stats

    if len(base) != len(system) or not base:
        raise InvalidArgument("paired comparison needs the same, non-empty set of queries")
    diff = np.asarray(system, dtype=np.float64) - np.asarray(base, dtype=np.float64)
    if np.ptp(diff) == 0:  # every query moved alike: no spread to resample
        low = high = float(diff[0])
        p_value = 1.0 if diff[0] == 0 else 0.0
    else:
        ci = stats.bootstrap(
            (diff,),
            np.mean,
            n_resamples=resamples,
            confidence_level=0.95,
            method="percentile",
            random_state=seed,
        ).confidence_interval
        low, high = float(ci.low), float(ci.high)
        p_value = float(stats.ttest_rel(system, base).pvalue)
    return {
        "wins": int((diff > 1e-12).sum()),
        "losses": int((diff < -1e-12).sum()),
        "ties": int((np.abs(diff) <= 1e-12).sum()),
        "mean_diff": round(float(diff.mean()), 4),
        "ci95": [round(low, 4), round(high, 4)],
        "p_value": round(p_value, 4),
    }
