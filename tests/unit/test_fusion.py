"""Fusion of dense and sparse lists: RRF and normalised weights, by hand and by property."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.common.domain import Document, Hit
from services.common.errors import InvalidArgument
from services.common.fusion import Fusion, Method, fuse, fuse_hits

DENSE = [("a", 0.9), ("b", 0.8), ("c", 0.1)]
SPARSE = [("c", 12.0), ("d", 7.0), ("a", 3.0)]


def test_rrf_sums_reciprocal_ranks_and_reports_both_ranks() -> None:
    fused = fuse(DENSE, SPARSE, Fusion(Method.RRF, rrf_k=60), k=10)
    score = {f.id: f.score for f in fused}
    assert score["a"] == pytest.approx(1 / 61 + 1 / 63)
    assert score["c"] == pytest.approx(1 / 63 + 1 / 61)
    assert score["d"] == pytest.approx(1 / 62)
    # a and c tie: the dense list's order first
    assert [f.id for f in fused] == ["a", "c", "b", "d"]
    ranks = {f.id: (f.dense_rank, f.sparse_rank) for f in fused}
    assert ranks == {"a": (1, 3), "b": (2, 0), "c": (3, 1), "d": (0, 2)}
    assert all(f.first_stage_score == f.score for f in fused)


def test_fused_hits_are_the_hits_given_with_the_fused_score_and_both_ranks() -> None:
    doc = Document("a", "text")
    dense = [Hit("a", 0.9, 2, 0.9, doc), Hit("b", 0.8, 0, 0.8)]
    sparse = [Hit("c", 12.0, 1, 12.0), Hit("a", 3.0, 2, 3.0)]
    fused = fuse_hits(dense, sparse, Fusion(Method.RRF, rrf_k=60), k=3)
    assert fused == [
        Hit("a", 1 / 61 + 1 / 62, 2, 1 / 61 + 1 / 62, doc, dense_rank=1, sparse_rank=2),
        Hit("c", 1 / 61, 1, 1 / 61, dense_rank=0, sparse_rank=1),
        Hit("b", 1 / 62, 0, 1 / 62, dense_rank=2, sparse_rank=0),
    ]
    assert dense[0].score == 0.9 and dense[0].dense_rank == 0, "the inputs are not changed"


def test_weighted_normalises_each_list_before_weighing() -> None:
    fused = fuse(DENSE, SPARSE, Fusion(Method.WEIGHTED, dense_weight=0.25), k=2)
    # min-max per list: dense a 1, b 0.875, c 0; sparse c 1, d 4/9, a 0
    assert [(f.id, round(f.score, 4)) for f in fused] == [("c", 0.75), ("d", 0.3333)]
    only_dense = fuse(DENSE, SPARSE, Fusion(Method.WEIGHTED, dense_weight=1.0), k=3)
    assert [f.id for f in only_dense] == ["a", "b", "c"]


def test_an_empty_list_leaves_the_other_in_its_order() -> None:
    for method in Method:
        assert [f.id for f in fuse(DENSE, [], Fusion(method), 5)] == ["a", "b", "c"]
        assert [f.id for f in fuse([], SPARSE, Fusion(method), 5)] == ["c", "d", "a"]
    assert fuse([], [], Fusion(), 5) == []


@pytest.mark.parametrize(
    "fusion",
    [dict(rrf_k=0), dict(rrf_k=10_001), dict(dense_weight=1.5), dict(dense_weight=float("nan"))],
)
def test_bad_fusion_parameters_are_invalid_arguments(fusion: dict[str, float]) -> None:
    with pytest.raises(InvalidArgument, match="fusion"):
        Fusion(**fusion)  # type: ignore[arg-type]


ranked = st.lists(st.text(min_size=1, max_size=3), unique=True, max_size=30).flatmap(
    lambda ids: st.lists(
        st.floats(-100, 100, allow_nan=False), min_size=len(ids), max_size=len(ids)
    ).map(lambda s: list(zip(ids, sorted(s, reverse=True), strict=True)))
)


@given(ranked, ranked, st.sampled_from(list(Method)), st.integers(1, 40))
def test_fusion_ranks_the_union_best_first(
    dense: list[tuple[str, float]], sparse: list[tuple[str, float]], method: Method, k: int
) -> None:
    fused = fuse(dense, sparse, Fusion(method), k)
    union = {d for d, _ in dense} | {d for d, _ in sparse}
    assert len(fused) == min(k, len(union))
    assert len({f.id for f in fused}) == len(fused) and {f.id for f in fused} <= union
    assert all(a.score >= b.score for a, b in itertools.pairwise(fused))
    for f in fused:
        assert (f.dense_rank > 0) == (f.id in dict(dense))
        assert (f.sparse_rank > 0) == (f.id in dict(sparse))
    if method is Method.RRF and fused:
        # a document first in both lists can never be beaten
        both = [d for d, _ in dense[:1] if sparse and sparse[0][0] == d]
        if both:
            assert fused[0].id == both[0]


def test_the_gateway_s_first_stage_per_mode() -> None:
    from services.common.domain import Hit, IndexResult
    from services.common.fusion import Mode
    from services.gateway.first_stage import Stage, first_stage

    def result() -> IndexResult:
        dense = [Hit(d, s, 0, s) for d, s in DENSE]
        sparse = [Hit(d, s, 1 if d == "d" else 0, s) for d, s in SPARSE]
        return IndexResult([dense], [], [sparse], [])

    dense = first_stage(Stage(Mode.DENSE, 3, 0, None), result(), 0, 2)
    assert [(h.id, h.dense_rank, h.sparse_rank) for h in dense] == [("a", 0, 0), ("b", 0, 0)]
    sparse = first_stage(Stage(Mode.SPARSE, 0, 3, None), result(), 0, 3)
    assert [(h.id, h.sparse_rank, h.score) for h in sparse] == [
        ("c", 1, 12.0),
        ("d", 2, 7.0),
        ("a", 3, 3.0),
    ]
    fusion = Fusion(Method.RRF)
    hybrid = first_stage(Stage(Mode.HYBRID, 3, 3, fusion), result(), 0, 4)
    assert [(h.id, h.shard, h.dense_rank, h.sparse_rank) for h in hybrid] == [
        ("a", 0, 1, 3),
        ("c", 0, 3, 1),
        ("b", 0, 2, 0),
        ("d", 1, 0, 2),
    ]
    assert all(h.score == h.first_stage_score for h in hybrid)
    assert [h.id for h in hybrid] == [f.id for f in fuse(DENSE, SPARSE, fusion, 4)]
