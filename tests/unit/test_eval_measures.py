"""The measures come from ir-measures, wired right: runs and answers derived by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from services.common.errors import InvalidArgument
from services.measures.entropy import contrastive_entropy
from services.measures.ranking import paired_comparison, score


def test_ndcg_recall_and_mrr_of_a_small_run() -> None:
    qrels = {"q1": {"a": 1, "b": 2}, "q2": {"c": 1}, "q3": {"z": 1}}
    run = {"q1": ["x", "b", "a"], "q2": ["c"], "q3": ["x", "y"]}
    s = score(run, qrels)
    # q1: DCG = 2/log2(3) + 1/log2(4) = 1.2619 + 0.5; ideal = 2/log2(2) + 1/log2(3) = 2.6309
    q1 = (2 / math.log2(3) + 1 / 2) / (2 + 1 / math.log2(3))
    assert s.per_query["ndcg_at_10"] == pytest.approx({"q1": q1, "q2": 1.0, "q3": 0.0})
    # both of q1's relevant documents are in its 3 hits; q3's is not
    assert s.per_query["recall_at_100"] == {"q1": 1.0, "q2": 1.0, "q3": 0.0}
    # first relevant hit: q1 at rank 2, q2 at rank 1, q3 none
    assert s.per_query["mrr_at_10"] == {"q1": 0.5, "q2": 1.0, "q3": 0.0}
    assert s.mean("mrr_at_10") == pytest.approx(0.5)


def test_rank_order_counts_not_the_hit_count_and_missing_queries_score_zero() -> None:
    qrels = {"q1": {"a": 1}, "q2": {"b": 1}}
    late = score({"q1": ["y", "z", "a"]}, qrels)
    assert late.per_query["mrr_at_10"] == {"q1": pytest.approx(1 / 3), "q2": 0.0}
    assert late.queries == ("q1", "q2")
    # only the 10 first hits count for nDCG@10 and MRR@10, 100 for recall
    deep = score({"q1": [f"d{i}" for i in range(10)] + ["a"], "q2": ["b"]}, qrels)
    assert deep.per_query["ndcg_at_10"]["q1"] == 0.0 and deep.per_query["mrr_at_10"]["q1"] == 0.0
    assert deep.per_query["recall_at_100"]["q1"] == 1.0


def test_queries_without_qrels_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="no qrels"):
        score({"q1": ["a"]}, {"q2": {"a": 1}}, queries=["q1"])


def test_paired_comparison() -> None:
    base = [0.5, 0.5, 0.2, 1.0]
    system = [0.7, 0.5, 0.1, 1.0]
    out = paired_comparison(base, system, resamples=2000)
    assert (out["wins"], out["losses"], out["ties"]) == (1, 1, 2)
    assert out["mean_diff"] == pytest.approx((0.2 - 0.1) / 4, abs=1e-4)
    assert out["ci95"][0] <= out["mean_diff"] <= out["ci95"][1]
    rng = np.random.default_rng(1)
    base = rng.uniform(0, 1, 300).tolist()
    consistent = [b + 0.05 + rng.normal(0, 0.01) for b in base]
    noisy = [b + rng.normal(0, 0.3) for b in base]
    gain = paired_comparison(base, consistent)
    assert gain["ci95"][0] > 0 and gain["p_value"] < 0.001
    low, high = paired_comparison(base, noisy)["ci95"]
    assert low < 0 < high
    with pytest.raises(InvalidArgument):
        paired_comparison([0.1, 0.2], [0.1])


def test_contrastive_entropy_of_a_tiny_case() -> None:
    # one query, its relevant doc (row 0) and 3 others; 3 negatives must be exactly rows 1..3
    q = np.array([[1.0, 0.0]], dtype=np.float32)
    docs = np.array([[1.0, 0.0], [0.0, 1.0], [0.0, -1.0], [-1.0, 0.0]], dtype=np.float32)
    # scores / 0.5: positive 2, negatives 0, 0, -2: -log(e^2 / (e^2 + 1 + 1 + e^-2))
    expected = -math.log(math.exp(2) / (math.exp(2) + 2 + math.exp(-2)))
    got = contrastive_entropy(q, docs, [(0, 0)], {0: {0}}, negatives=3, temperature=0.5)
    assert got == pytest.approx(expected)
    # a better model (the relevant doc farther ahead) has a lower entropy
    sharper = contrastive_entropy(q, docs, [(0, 0)], {0: {0}}, negatives=3, temperature=0.1)
    assert sharper < got
    # a relevant document is never drawn as a negative: with row 1 relevant too, only
    # rows 2 and 3 can be negatives, and asking for 3 is refused
    with pytest.raises(InvalidArgument, match="negatives"):
        contrastive_entropy(q, docs, [(0, 0)], {0: {0, 1}}, negatives=3, temperature=0.5)
    two = contrastive_entropy(q, docs, [(0, 0)], {0: {0, 1}}, negatives=2, temperature=0.5)
    assert two == pytest.approx(-math.log(math.exp(2) / (math.exp(2) + 1 + math.exp(-2))))
