"""The settings ``tune`` chooses on the validation queries: each encoder's fusion, and the
reranker's depth and interpolation weight.

Fusion grid: the weighted fusion at dense weights 0.1 … 0.9 and RRF at k 10, 20, 60 and
100, each with 20, 50 or 100 candidates per list (at most the run's depth). The gateway's
default (weighted 0.5, 100 candidates) is tried first, so a tie keeps it.

Rerank: CELI's score and the first stage's over the top ``d`` candidates, each min-max
normalised over those ``d``, combined as ``w·rerank + (1 − w)·first stage``
(:func:`interpolate`; ``w = 1`` is the reranker's order alone); the candidates below ``d``
keep their first-stage order after them. Depths are those of the rerank cost table that
fit the budget; weights 0.2 … 1.0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.common.fusion import Fusion, Method, fuse
from services.common.retrieval_setting import interpolated_order
from services.measures.ranking import score
from services.tune.lists import Lists, Run, ScoredRun

WEIGHTS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
RRF_KS = (10, 20, 60, 100)
CANDIDATES = (100, 50, 20)
RERANK_WEIGHTS = (1.0, 0.8, 0.6, 0.5, 0.4, 0.2)
NDCG = "ndcg_at_10"


@dataclass(frozen=True)
class FusionChoice:
    fusion: Fusion
    candidates: int
    val_ndcg_at_10: float

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {"method": self.fusion.method.value, "candidates": self.candidates}
        if self.fusion.method is Method.RRF:
            d["rrf_k"] = self.fusion.rrf_k
        else:
            d["dense_weight"] = self.fusion.dense_weight
        d["val_ndcg_at_10"] = round(self.val_ndcg_at_10, 4)
        return d


@dataclass(frozen=True)
class RerankChoice:
    depth: int
    weight: float
    val_ndcg_at_10: float


def fusion_grid(depth: int) -> list[tuple[Fusion, int]]:
    fusions = [Fusion(Method.WEIGHTED, dense_weight=0.5)]
    fusions += [Fusion(Method.WEIGHTED, dense_weight=w) for w in WEIGHTS if w != 0.5]
    fusions += [Fusion(Method.RRF, rrf_k=k) for k in RRF_KS]
    sizes = [c for c in CANDIDATES if c <= depth] or [depth]
    return [(f, c) for c in sizes for f in fusions]


def fused_scored(
    lists: Lists, fusion: Fusion, candidates: int, qids: Sequence[str], depth: int
) -> ScoredRun:
    """The hybrid list of each query: each list's top ``candidates`` fused, top ``depth``."""
    return {
        q: [
            (h.id, h.score)
            for h in fuse(lists.dense[q][:candidates], lists.sparse[q][:candidates], fusion, depth)
        ]
        for q in qids
    }


def ids(run: ScoredRun) -> Run:
    return {q: [d for d, _ in hits] for q, hits in run.items()}


def mean_ndcg(run: Mapping[str, Sequence[str]], qrels: Any, qids: Sequence[str]) -> float:
    return score(run, qrels, list(qids)).mean(NDCG)


def choose_fusion(
    lists: Lists, qrels: Any, val: Sequence[str], depth: int
) -> tuple[FusionChoice, list[dict[str, Any]]]:
    """The best fusion and candidate depth on ``val`` (first best wins a tie), and the grid."""
    table = []
    best: FusionChoice | None = None
    for fusion, candidates in fusion_grid(depth):
        value = mean_ndcg(ids(fused_scored(lists, fusion, candidates, val, depth)), qrels, val)
        choice = FusionChoice(fusion, candidates, value)
        table.append(choice.describe())
        if best is None or value > best.val_ndcg_at_10 + 1e-12:
            best = choice
    assert best is not None
    return best, table


def interpolate(
    first: Sequence[tuple[str, float]], rerank: Mapping[str, float], depth: int, weight: float
) -> list[str]:
    """The first ``depth`` of ``first`` ordered by ``weight·minmax(rerank) + (1 −
    weight)·minmax(first-stage score)`` (the gateway's rule:
    :func:`services.common.retrieval_setting.interpolated_order`); the rest keep their
    first-stage order after them. Ties keep first-stage order."""
    head, tail = list(first[:depth]), [d for d, _ in first[depth:]]
    mixed = interpolated_order([rerank[d] for d, _ in head], [s for _, s in head], weight)
    return [head[i][0] for i, _ in mixed] + tail


def reranked(
    first: ScoredRun, scores: Mapping[str, Mapping[str, float]], depth: int, weight: float
) -> Run:
    return {q: interpolate(first[q], scores[q], depth, weight) for q in scores}


def choose_rerank(
    first: ScoredRun,
    scores: Mapping[str, Mapping[str, float]],
    qrels: Any,
    val: Sequence[str],
    depths: Sequence[int],
) -> tuple[RerankChoice | None, list[dict[str, Any]]]:
    """The best (depth, weight) on ``val`` among ``depths`` (those within the budget)."""
    table = []
    best: RerankChoice | None = None
    sub = {q: scores[q] for q in val}
    for depth in sorted(depths):
        for weight in RERANK_WEIGHTS:
            value = mean_ndcg(reranked(first, sub, depth, weight), qrels, val)
            table.append({"depth": depth, "weight": weight, "val_ndcg_at_10": round(value, 4)})
            if best is None or value > best.val_ndcg_at_10 + 1e-12:
                best = RerankChoice(depth, weight, value)
    return best, table
