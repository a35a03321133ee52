"""A search's rerank: its depth (named by the request, else by the serving generation's
retrieval setting, else chosen from the reranker's measured depth table for the time
left, shed under load), the checkpoint that scores it (the generation's, else the rerank
service's default model), and the answer it reorders, its score interpolated with the
first stage's when the generation's ``rerank_weight`` is below 1 (:func:`interpolate`).

No grpc here (see :mod:`services.gateway.pipeline`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from services.common.deadline import Deadline
from services.common.errors import DeadlineExceeded, NotFound
from services.common.retrieval_setting import RetrievalSetting, interpolated_order
from services.gateway.budget import bounded, ms_since, rerank_deadline
from services.gateway.domain import Hit, SearchQuery, SearchResult, Timings
from services.gateway.ports import Reranker

# Share of the remaining budget that rerank may use when it picks its own depth.
RERANK_BUDGET_SHARE = 0.6


@dataclass(frozen=True)
class RerankPlan:
    """How one query's rerank runs: its depth (0: none), why it is skipped, whether the
    depth was the gateway's estimate (then running out of time skips the rerank instead
    of failing the search), the checkpoint ("" = the service's default) and the weight
    of the reranker's score (1: its order alone)."""

    depth: int = 0
    skipped: str = ""
    # whose depth: the request's, the serving generation's setting's, the depth table's
    source: Literal["request", "setting", "table"] = "table"
    checkpoint: str = ""
    weight: float = 1.0

    @property
    def estimated(self) -> bool:
        """The request named no depth: a rerank out of time is skipped, not an error."""
        return self.source != "request"


def interpolate(candidates: Sequence[Hit], reranked: Sequence[Hit], weight: float) -> list[Hit]:
    """The ``reranked`` hits (the reranker's answer: ``score`` its own) ordered by
    :func:`~services.common.retrieval_setting.interpolated_order` of their reranker and
    first-stage scores over ``candidates`` (the same hits in first-stage order), ``score``
    the mixed one; ``weight`` 1 returns ``reranked`` as it is (the reranker's order and
    scores)."""
    if weight >= 1.0 or not reranked:
        return list(reranked)
    by_id = {h.id: h for h in reranked}
    order = [h for h in candidates if h.id in by_id]
    mixed = interpolated_order(
        [by_id[h.id].score for h in order], [h.first_stage_score for h in order], weight
    )
    return [dataclasses.replace(by_id[order[i].id], score=score) for i, score in mixed]


def rerank_plan(
    q: SearchQuery,
    deadline: Deadline,
    reranker: Reranker | None,
    pressure: Callable[[], float],
    setting: RetrievalSetting | None = None,
) -> RerankPlan:
    """The rerank of ``q`` (:func:`rerank_depth`), with the checkpoint and weight of the
    serving generation's ``setting`` (None: the service's default model, its order)."""
    default = setting.rerank_depth if setting is not None else 0
    depth, skipped = rerank_depth(q, deadline, reranker, pressure, default)
    source: Literal["request", "setting", "table"] = (
        "request" if q.rerank_depth else "setting" if default else "table"
    )
    if setting is None:
        return RerankPlan(depth, skipped, source)
    return RerankPlan(depth, skipped, source, setting.rerank_checkpoint, setting.rerank_weight)


def rerank_depth(
    q: SearchQuery,
    deadline: Deadline,
    reranker: Reranker | None,
    pressure: Callable[[], float],
    default_depth: int = 0,
) -> tuple[int, str]:
    """(depth, why the rerank is skipped). The depth the request names, else
    ``default_depth`` (the serving generation's, 0: none), else the largest one the
    reranker's table fits into its share of the time left (at least k); none fits:
    (0, the reason), the hits keep their first-stage order.

    Under load the rerank is the optional work shed first: past the gateway's
    high-water mark of in-flight requests the named depth, or the budget the depth
    is chosen by, shrinks by ``1 - pressure`` (never below k), and at the limit the
    rerank is skipped and the response says so; searches are refused only over it.
    """
    if not q.rerank or reranker is None:
        return 0, ""
    keep = 1.0 - pressure()
    if keep <= 0.0:
        return 0, "shed under load: the gateway is at its limit of in-flight requests"
    # the generation's depth, like the table's, is at least k (a request's is checked so)
    named = q.rerank_depth or (max(q.k, default_depth) if default_depth else 0)
    if named:
        return max(min(q.k, named), int(named * keep)), ""
    budget = deadline.remaining_ms(default=1000.0) * RERANK_BUDGET_SHARE * keep
    depth = reranker.depth_for_budget(budget)
    if depth == 0:
        return 0, (
            f"no measured rerank depth fits {budget:.0f} ms "
            f"({RERANK_BUDGET_SHARE:.0%} of the time left"
            + (f", {keep:.0%} of it under load)" if keep < 1.0 else ")")
        )
    return max(q.k, depth), ""


async def finish(
    q: SearchQuery,
    plan: RerankPlan,
    hits: list[Hit],
    missing: list[int],
    deadline: Deadline,
    reranker: Reranker | None,
) -> SearchResult:
    """One query's answer: its hits reranked to ``plan``'s depth by its checkpoint and
    mixed with the first stage by its weight (kept in first-stage order when a rerank
    whose depth the request did not name runs out of time, or its checkpoint is not
    found), cut to k."""
    timings = Timings()
    depth, skipped = plan.depth, plan.skipped
    result = SearchResult(
        hits=hits,
        model="",
        partial=bool(missing),
        missing_shards=missing,
        timings=timings,
        rerank_skipped=bool(skipped),
        rerank_skipped_reason=skipped,
    )
    if depth > 0 and reranker is not None and hits:
        t = time.perf_counter()
        candidates = hits[:depth]
        chosen = plan.estimated  # the depth is not the request's
        bound = rerank_deadline(deadline) if chosen else deadline
        try:
            reranked = await bounded(
                reranker.rerank(
                    q.text, candidates, timeout=bound.remaining(), checkpoint=plan.checkpoint
                ),
                bound,
                "the rerank",
            )
        except DeadlineExceeded:
            if not chosen:
                raise
            result.rerank_skipped = True
            why = "set by the serving generation's retrieval setting"
            if plan.source != "setting":
                why = "chosen from the measured depth table, which this reranker is slower than now"
            result.rerank_skipped_reason = (
                f"the rerank of {len(candidates)} candidates did not finish in the "
                f"{ms_since(t):.0f} ms left (its depth was {why})"
            )
        except NotFound as exc:
            if not plan.checkpoint:
                raise
            # the generation names a checkpoint the rerank service does not have
            result.rerank_skipped = True
            result.rerank_skipped_reason = (
                f"the serving generation's rerank checkpoint {plan.checkpoint!r} is not "
                f"served: {exc.message}"
            )
        else:
            hits = interpolate(candidates, reranked, plan.weight)
            result.reranked = True
            result.rerank_depth = len(candidates)
        timings.rerank_ms = ms_since(t)
    if q.ids_only:
        for hit in hits:
            hit.document = None
    result.hits = hits[: q.k]
    return result
