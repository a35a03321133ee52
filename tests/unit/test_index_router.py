"""The router's merge: pure functions, no servers."""

from __future__ import annotations

import pytest

from services.common.deadline import Deadline
from services.common.domain import Hit, IndexResult
from services.common.errors import DeadlineExceeded, InvalidArgument, Unavailable
from services.index.client.merge import merge_results, shard_deadline
from services.index.core.query import Consistency, IndexQuery, ShardAnswer, TopK


def answer(shard: int, *rows: list[tuple[str, float]], width: int | None = None) -> ShardAnswer:
    return ShardAnswer(TopK.from_hits(rows, width), shard, f"r{shard}", "1-0")


def test_merge_top_k_by_score_across_shards() -> None:
    a = answer(0, [("a1", 0.9), ("a2", 0.5)])
    b = answer(1, [("b1", 0.7), ("b2", 0.6)], width=4)  # padded: 2 hits in 4 columns
    merged = merge_results([a, b], 1, 3, True).hits[0]
    assert [(h.id, h.shard) for h in merged] == [("a1", 0), ("b1", 1), ("b2", 1)]
    assert [h.score for h in merged] == pytest.approx([0.9, 0.7, 0.6])
    assert [h.id for h in merge_results([a, b], 1, 9, True).hits[0]] == ["a1", "b1", "b2", "a2"]
    empty = [answer(0, [], width=5), answer(1, [], width=0)]
    assert merge_results(empty, 1, 5, True).hits == [[]]
    tie = merge_results([answer(0, [("x", 0.5)]), answer(1, [("y", 0.5)])], 1, 1, True)
    assert tie.hits[0][0].id == "x"  # ties: the lower shard first


def test_merge_matches_a_sort_of_every_hit() -> None:
    """Random grids of different widths per shard: the same top-k as sorting all hits."""
    import numpy as np

    rng = np.random.default_rng(4)
    for trial in range(20):
        rows, k = 1 + trial % 4, 1 + trial % 7
        per_shard = [
            [
                sorted(
                    [(f"s{s}-q{q}-{i}", float(rng.integers(0, 20))) for i in range(n)],
                    key=lambda h: -h[1],
                )
                for q in range(rows)
                for n in [int(rng.integers(0, 6))]
            ]
            for s in range(3)
        ]
        answers = [answer(s, *per_shard[s], width=int(rng.integers(5, 8))) for s in range(3)]
        merged = merge_results(answers, rows, k, True)
        for q in range(rows):
            every = [(d, sc, s) for s in range(3) for d, sc in per_shard[s][q]]
            expected = sorted(every, key=lambda h: -h[1])[:k]  # stable: shard order on ties
            assert [(h.id, h.score, h.shard) for h in merged.hits[q]] == expected


def test_merge_results_per_query_and_partial() -> None:
    answers: list[ShardAnswer | BaseException] = [
        answer(0, [("a", 0.9), ("b", 0.1)], [("c", 0.3)]),
        Unavailable("shard 1 down"),
        answer(2, [("d", 0.5)], [("e", 0.8)]),
    ]
    result = merge_results(answers, num_queries=2, k=2, require_complete=False)
    assert result.missing_shards == [1]
    assert [[(h.id, h.shard) for h in row] for row in result.hits] == [
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
    from services.index.client.merge import split_result

    rows = [
        [Hit(f"{q}-{i}", 1.0 - i / 10, i % 2, 1.0 - i / 10) for i in range(5)] for q in range(3)
    ]
    parts = split_result(IndexResult(rows, [1]), [5, 2, 1])
    assert [len(p.hits[0]) for p in parts] == [5, 2, 1]
    assert parts[1].hits == [rows[1][:2]] and all(p.missing_shards == [1] for p in parts)


def test_merge_answers_merges_each_list_and_names_shards_without_a_sparse_one() -> None:
    from services.index.client.merge import merge_answers

    a = answer(0, [("a1", 0.9), ("a2", 0.5)])
    a.sparse = TopK.from_hits([[("a2", 12.0), ("a3", 3.0)]])
    b = answer(1, [("b1", 0.7)])
    b.sparse = TopK.from_hits([[("b9", 8.0)]], width=3)
    c = answer(2, [("c1", 0.8)])
    c.sparse_unavailable = "no text index"
    merged = merge_answers([a, b, c, Unavailable("down")], 1, 3, 5, False)
    assert [h.id for h in merged.hits[0]] == ["a1", "c1", "b1"]
    assert merged.sparse is not None
    assert [(h.id, h.shard, h.score) for h in merged.sparse[0]] == [
        ("a2", 0, 12.0),
        ("b9", 1, 8.0),
        ("a3", 0, 3.0),
    ]
    assert merged.missing_shards == [3] and merged.sparse_missing_shards == [2]
    # a sparse-only search: no dense list (the shards answered an empty grid)
    a.top, b.top = TopK.empty(0, 0), TopK.empty(0, 0)
    only = merge_answers([a, b], 1, 0, 5, False)
    assert only.hits == [[]] and only.sparse is not None
    assert [h.id for h in only.sparse[0]] == ["a2", "b9", "a3"]
    # no shard had a sparse list: dense hits stay, the sparse list is empty
    none = merge_answers([c], 1, 3, 5, False)
    assert none.sparse == [[]] and none.sparse_missing_shards == [0] and none.hits[0]


def test_split_result_cuts_each_sparse_row_to_its_own_sparse_k() -> None:
    from services.index.client.merge import split_result

    rows = [[Hit(f"{q}-{i}", 1.0, 0, 1.0) for i in range(4)] for q in range(2)]
    parts = split_result(IndexResult(rows, [], rows, [1]), [4, 4], [1, 3])
    assert [len(p.sparse[0]) for p in parts if p.sparse is not None] == [1, 3]
    assert all(p.sparse_missing_shards == [1] for p in parts)


def test_index_query_as_each_shard_gets_it() -> None:
    import numpy as np

    token = {0: "5-0"}
    session = IndexQuery(
        np.ones((2, 4), np.float32),
        7,
        nprobe=3,
        filter=[("par", ("1",))],
        consistency=Consistency.SESSION,
        write_token=token,
        texts=("a", "b"),
        sparse_k=9,
    )
    first, second = session.shard_query(0), session.shard_query(1)
    assert session.rows == 2
    assert (first.shard, first.k, first.nprobe, first.min_position) == (0, 7, 3, "5-0")
    assert (first.texts, first.sparse_k, list(first.filter)) == (("a", "b"), 9, [("par", ("1",))])
    assert second.min_position == ""  # not in the token: nothing to wait for
    eventual = IndexQuery(np.ones((1, 4), np.float32), 7, write_token=token)
    assert eventual.shard_query(0).min_position == ""  # the token counts under SESSION only
    sparse = IndexQuery(None, 0, texts=("a",), sparse_k=5).shard_query(1)
    assert sparse.vectors.shape == (0, 0) and sparse.k == 0 and sparse.texts == ("a",)
    assert IndexQuery(None, 0, texts=("a", "b", "c"), sparse_k=5).rows == 3
