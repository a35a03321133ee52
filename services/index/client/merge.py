"""The merge of the shards' answers into one top-k per query (pure: no grpc, no I/O).

The shards' score grids are merged side by side, vectorised over the batch
(:func:`merge_results`); a search with sparse lists has each list merged over the shards
(:func:`merge_answers`; BM25 scores are each shard's, as in Elasticsearch's
query-then-fetch), the fusion left to the caller; a coalesced wave's merged result is cut
into one result per request (:func:`split_result`). A shard that did not answer is in
``missing_shards`` unless the caller asked for complete results; when no shard answered,
the search fails (:func:`no_shard_answered`). The router keeps back from the shards the
time this and its caller need (:func:`shard_deadline`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import numpy as np

from services.common.deadline import Deadline
from services.common.domain import Hit, IndexResult
from services.common.errors import DeadlineExceeded, RetrievalError, Unavailable
from services.index.core.query import PAD_ID, ShardAnswer, TopK

log = logging.getLogger(__name__)

# Time kept back from the shards for merging and answering.
RESERVE_FRACTION = 0.1
RESERVE_MIN_S = 0.005
OUTAGES = (Unavailable, DeadlineExceeded)


def merge_results(
    answers: Sequence[ShardAnswer | BaseException],
    num_queries: int,
    k: int,
    require_complete: bool,
) -> IndexResult:
    """Merge the shards' answers (in shard order); outages become ``missing_shards``.

    Vectorised over the batch: the shards' score grids side by side, one stable sort
    per row (ties: the lower shard first, then the shard's own order), and Python
    objects only for the k hits kept per query.
    """
    tops: list[TopK] = []
    shard_of: list[int] = []
    missing: list[int] = []
    for shard, answer in enumerate(answers):
        if isinstance(answer, OUTAGES) and not require_complete:
            log.warning("partial result without shard %d: %s", shard, answer)
            missing.append(shard)
            continue
        if isinstance(answer, BaseException):
            raise answer
        if answer.top.rows != num_queries:
            raise Unavailable(f"shard {shard} answered {answer.top.rows} of {num_queries}")
        if answer.top.width:
            tops.append(answer.top)
            shard_of.append(shard)
    if len(missing) == len(answers):
        raise no_shard_answered(answers)
    if not tops:
        return IndexResult([[] for _ in range(num_queries)], missing)
    widths = np.array([t.width for t in tops])
    starts = np.concatenate([[0], np.cumsum(widths)[:-1]])
    scores = np.concatenate([t.scores for t in tops], axis=1)
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    which = np.searchsorted(starts, order, side="right") - 1  # index into tops
    flat = np.arange(num_queries)[:, None] * widths[which] + (order - starts[which])
    kept = np.take_along_axis(scores, order, axis=1).tolist()
    ids = [t.ids for t in tops]
    hits = [
        [
            Hit(ids[t][f], s, shard_of[t], s)
            for t, f, s in zip(t_row, f_row, s_row, strict=True)
            if ids[t][f] != PAD_ID
        ]
        for t_row, f_row, s_row in zip(which.tolist(), flat.tolist(), kept, strict=True)
    ]
    return IndexResult(hits, missing)


def merge_answers(
    answers: Sequence[ShardAnswer | BaseException],
    num_queries: int,
    k: int,
    sparse_k: int,
    require_complete: bool,
) -> IndexResult:
    """:func:`merge_results` of the dense lists (none when ``k`` is 0: a sparse-only
    search) and, with ``sparse_k``, of the sparse ones."""
    if k:
        result = merge_results(answers, num_queries, k, require_complete)
    else:
        empty = TopK.empty(num_queries, 0)
        blank = [
            dataclasses.replace(a, top=empty) if isinstance(a, ShardAnswer) else a for a in answers
        ]
        result = merge_results(blank, num_queries, 1, require_complete)
    if not sparse_k:
        return result
    lists: list[ShardAnswer | BaseException] = []
    for shard, answer in enumerate(answers):
        if not isinstance(answer, ShardAnswer):
            lists.append(answer)
        elif answer.sparse is None:
            result.sparse_missing_shards.append(shard)
            lists.append(Unavailable(answer.sparse_unavailable or f"shard {shard}: no sparse list"))
        else:
            lists.append(dataclasses.replace(answer, top=answer.sparse))
    if len(result.sparse_missing_shards) + len(result.missing_shards) == len(answers):
        result.sparse = [[] for _ in range(num_queries)]  # nothing to merge: dense only
    else:
        result.sparse = merge_results(lists, num_queries, sparse_k, False).hits
    return result


def no_shard_answered(answers: Sequence[ShardAnswer | BaseException]) -> RetrievalError:
    """The error of a search that no shard answered: an empty OK would claim "no match".

    DeadlineExceeded when the time ran out on any shard (the caller's budget is spent),
    else Unavailable (every replica of every shard is down: safe to retry).
    """
    details = "; ".join(str(a) for a in answers)
    if any(isinstance(a, DeadlineExceeded) for a in answers):
        return DeadlineExceeded(f"no shard answered within the deadline ({details})")
    return Unavailable(f"no shard answered ({details})")


def split_result(
    result: IndexResult, ks: Sequence[int], sparse_ks: Sequence[int] | None = None
) -> list[IndexResult]:
    """One result per coalesced request (one query row each), cut to its own k (and
    sparse k)."""
    sparse_ks = sparse_ks if sparse_ks is not None else [0] * len(ks)
    sparse = result.sparse
    return [
        IndexResult(
            hits=[row[:k]],
            missing_shards=list(result.missing_shards),
            sparse=None if sparse is None else [sparse[i][:sk]],
            sparse_missing_shards=list(result.sparse_missing_shards),
        )
        for i, (row, k, sk) in enumerate(zip(result.hits, ks, sparse_ks, strict=True))
    ]


def shard_deadline(overall: Deadline) -> Deadline:
    """The overall deadline minus the router's reserve."""
    remaining = overall.remaining()
    if remaining is None:
        return overall
    return Deadline.after(max(0.0, remaining - max(RESERVE_MIN_S, remaining * RESERVE_FRACTION)))
