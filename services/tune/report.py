"""The tuning report: every system side by side on the dev queries.

Each system carries nDCG@10, Recall@100 and MRR@10 on dev (``ir-measures``), its nDCG@10
on the validation queries (where every choice was made), and a paired comparison with
what serves now (wins / losses / ties, mean difference, bootstrap 95 % interval, paired
t-test: :func:`services.measures.ranking.paired_comparison`). ``best`` is the system with
the highest validation nDCG@10 among those within the latency budget (never an exact-search
ceiling); ``best_without_rerank`` the same among first stages.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.measures.ranking import paired_comparison, score
from services.tune.lists import Run

NDCG = "ndcg_at_10"


@dataclass
class System:
    run: Run
    kind: str  # "first_stage", "reranked", "ceiling"
    setting: dict[str, Any] = field(default_factory=dict)
    eligible: bool = True  # within the budget (a candidate for ``best``)


def _round(d: Mapping[str, float]) -> dict[str, float]:
    return {k: round(v, 4) for k, v in d.items()}


def build_report(
    systems: Mapping[str, System],
    qrels: Any,
    val: Sequence[str],
    dev: Sequence[str],
    serving: str,
) -> dict[str, Any]:
    dev_scores = {name: score(s.run, qrels, list(dev)) for name, s in systems.items()}
    val_ndcg = {
        name: score({q: s.run[q] for q in val if q in s.run}, qrels, list(val)).mean(NDCG)
        for name, s in systems.items()
    }
    base = dev_scores[serving].values(NDCG)
    rows: dict[str, Any] = {}
    for name, s in systems.items():
        rows[name] = {
            "kind": s.kind,
            **_round(dev_scores[name].means()),
            "val_ndcg_at_10": round(val_ndcg[name], 4),
            "eligible": s.eligible,
            "setting": s.setting,
            "vs_serving": None
            if name == serving
            else paired_comparison(base, dev_scores[name].values(NDCG)),
        }

    def pick(kinds: tuple[str, ...]) -> str:
        names = [n for n, s in systems.items() if s.kind in kinds and s.eligible]
        return max(names, key=lambda n: (val_ndcg[n], n == serving))

    without = pick(("first_stage",))
    best = pick(("first_stage", "reranked"))
    vs_without = (
        None
        if best == without
        else paired_comparison(dev_scores[without].values(NDCG), dev_scores[best].values(NDCG))
    )
    return {
        "serving": serving,
        "systems": rows,
        "best_without_rerank": {"system": without, NDCG: rows[without][NDCG]},
        "best": {
            "system": best,
            NDCG: rows[best][NDCG],
            "val_ndcg_at_10": rows[best]["val_ndcg_at_10"],
            "setting": systems[best].setting,
            "vs_serving": rows[best]["vs_serving"],
            "vs_best_without_rerank": vs_without,
            "paired_low_vs_best_without_rerank": None
            if vs_without is None
            else vs_without["ci95"][0],
            "paired_low_vs_serving": None
            if rows[best]["vs_serving"] is None
            else rows[best]["vs_serving"]["ci95"][0],
        },
    }


def head_to_head(
    systems: Mapping[str, System], qrels: Any, dev: Sequence[str], pairs: Sequence[tuple[str, str]]
) -> list[dict[str, Any]]:
    """The paired comparison on dev of each (baseline, system) pair both of which exist:
    the recipes compared (encoder negatives from the hybrid run against the dense ranks,
    the reranker trained on its first stage against today's recipe)."""
    out = []
    for base, system in pairs:
        if base in systems and system in systems:
            a = score(systems[base].run, qrels, list(dev)).values(NDCG)
            b = score(systems[system].run, qrels, list(dev)).values(NDCG)
            out.append({"baseline": base, "system": system, **paired_comparison(a, b)})
    return out
