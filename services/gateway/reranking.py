"""A search's rerank: its depth (named by the request, else chosen from the reranker's
measured depth table for the time left, shed under load) and the answer it reorders.

No grpc here (see :mod:`services.gateway.pipeline`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from services.common.deadline import Deadline
from services.common.errors import DeadlineExceeded
from services.gateway.budget import bounded, ms_since, rerank_deadline
from services.gateway.domain import Hit, SearchQuery, SearchResult, Timings
from services.gateway.ports import Reranker

# Share of the remaining budget that rerank may use when it picks its own depth.
RERANK_BUDGET_SHARE = 0.6


def rerank_depth(
    q: SearchQuery, deadline: Deadline, reranker: Reranker | None, pressure: Callable[[], float]
) -> tuple[int, str]:
    """(depth, why the rerank is skipped). The depth the request names, else the
    largest one the reranker's table fits into its share of the time left (at least
    k); none fits: (0, the reason), the hits keep their first-stage order.

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
    if q.rerank_depth:
        return max(min(q.k, q.rerank_depth), int(q.rerank_depth * keep)), ""
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
    plan: tuple[int, str],
    hits: list[Hit],
    missing: list[int],
    deadline: Deadline,
    reranker: Reranker | None,
) -> SearchResult:
    """One query's answer: its hits reranked to ``plan``'s depth (kept in first-stage order
    when an automatic-depth rerank runs out of time), cut to k."""
    timings = Timings()
    depth, skipped = plan
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
        chosen = not q.rerank_depth  # the depth is the gateway's estimate
        bound = rerank_deadline(deadline) if chosen else deadline
        try:
            hits = await bounded(
                reranker.rerank(q.text, candidates, timeout=bound.remaining()),
                bound,
                "the rerank",
            )
        except DeadlineExceeded:
            if not chosen:
                raise
            result.rerank_skipped = True
            result.rerank_skipped_reason = (
                f"the rerank of {len(candidates)} candidates did not finish in the "
                f"{ms_since(t):.0f} ms left (its depth was chosen from the measured depth "
                "table, which this reranker is slower than now)"
            )
        else:
            result.reranked = True
            result.rerank_depth = len(candidates)
        timings.rerank_ms = ms_since(t)
    if q.ids_only:
        for hit in hits:
            hit.document = None
    result.hits = hits[: q.k]
    return result
