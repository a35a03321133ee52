"""The router's merge: pure functions, no servers."""

from __future__ import annotations

import pytest

from services.common.deadline import Deadline
from services.common.errors import DeadlineExceeded, InvalidArgument, Unavailable
from services.index.query import ShardAnswer
from services.index.router import RoutedHit, merge_results, merge_top_k, shard_deadline


def answer(shard: int, *rows: list[tuple[str, float]]) -> ShardAnswer:
    return ShardAnswer([list(r) for r in rows], shard, f"r{shard}", "1-0")


def test_merge_top_k_by_score_across_shards() -> None:
    a = [RoutedHit("a1", 0.9, 0), RoutedHit("a2", 0.5, 0)]
    b = [RoutedHit("b1", 0.7, 1), RoutedHit("b2", 0.6, 1)]
    assert [h.doc_id for h in merge_top_k([a, b], 3)] == ["a1", "b1", "b2"]
    assert merge_top_k([[], []], 5) == []
    tie = merge_top_k([[RoutedHit("x", 0.5, 0)], [RoutedHit("y", 0.5, 1)]], 1)
    assert tie[0].doc_id == "x"  # ties: the lower shard first


def test_merge_results_per_query_and_partial() -> None:
    answers: list[ShardAnswer | BaseException] = [
        answer(0, [("a", 0.9), ("b", 0.1)], [("c", 0.3)]),
        Unavailable("shard 1 down"),
        answer(2, [("d", 0.5)], [("e", 0.8)]),
    ]
    result = merge_results(answers, num_queries=2, k=2, require_complete=False)
    assert result.missing_shards == [1]
    assert [[(h.doc_id, h.shard) for h in row] for row in result.hits] == [
        [("a", 0), ("d", 2)],
        [("e", 2), ("c", 0)],
    ]
    with pytest.raises(Unavailable):
        merge_results(answers, num_queries=2, k=2, require_complete=True)
    late: list[ShardAnswer | BaseException] = [answer(0, [("a", 1.0)]), DeadlineExceeded("slow")]
    assert merge_results(late, 1, 5, False).missing_shards == [1]
    with pytest.raises(DeadlineExceeded):
        merge_results(late, 1, 5, True)


def test_caller_errors_are_never_partial() -> None:
    with pytest.raises(InvalidArgument):
        merge_results([InvalidArgument("k"), answer(1, [])], 1, 5, require_complete=False)
    with pytest.raises(Unavailable, match="answered 2 of 1"):
        merge_results([answer(0, [], [])], 1, 5, require_complete=False)


def test_shard_deadline_keeps_a_reserve() -> None:
    assert shard_deadline(Deadline(None)).at is None
    left = shard_deadline(Deadline.after(1.0)).remaining()
    assert left is not None and 0.85 < left <= 0.9
    tiny = shard_deadline(Deadline.after(0.004)).remaining()
    assert tiny == 0.0


def test_split_result_gives_each_request_its_row_and_k() -> None:
    from services.index.router import RoutedResult, split_result

    rows = [[RoutedHit(f"{q}-{i}", 1.0 - i / 10, i % 2) for i in range(5)] for q in range(3)]
    parts = split_result(RoutedResult(rows, [1]), [5, 2, 1])
    assert [len(p.hits[0]) for p in parts] == [5, 2, 1]
    assert parts[1].hits == [rows[1][:2]] and all(p.missing_shards == [1] for p in parts)
