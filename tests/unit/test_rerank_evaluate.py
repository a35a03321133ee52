"""The rerank evaluation: the paired comparison that says whether a reranker's gain over
dense is more than noise, and the one rerank loop (``rerank evaluate`` and ``eval``)."""

from __future__ import annotations

import numpy as np
import pytest

from services.common.errors import InvalidArgument
from services.eval.rerank import TERMS, rerank_runs
from services.measures.ranking import paired_comparison
from services.rerank.serve.scorer import CeliScorer
from tests.support.rerank import tiny_scorer


def test_counts_and_mean_difference() -> None:
    base = [0.5, 0.5, 0.2, 1.0]
    system = [0.7, 0.5, 0.1, 1.0]
    out = paired_comparison(base, system, resamples=2000)
    assert (out["wins"], out["losses"], out["ties"]) == (1, 1, 2)
    assert out["mean_diff"] == pytest.approx((0.2 - 0.1) / 4, abs=1e-4)
    low, high = out["ci95"]
    assert low <= out["mean_diff"] <= high


def test_interval_excludes_zero_only_for_a_consistent_gain() -> None:
    rng = np.random.default_rng(1)
    base = rng.uniform(0, 1, 300).tolist()
    consistent = [b + 0.05 + rng.normal(0, 0.01) for b in base]
    noisy = [b + rng.normal(0, 0.3) for b in base]
    assert paired_comparison(base, consistent)["ci95"][0] > 0
    low, high = paired_comparison(base, noisy)["ci95"]
    assert low < 0 < high


def test_needs_the_same_queries() -> None:
    with pytest.raises(InvalidArgument):
        paired_comparison([0.1, 0.2], [0.1])
    with pytest.raises(InvalidArgument):
        paired_comparison([], [])


@pytest.fixture(scope="module")
def scorer(tmp_path_factory: pytest.TempPathFactory) -> CeliScorer:
    return tiny_scorer(tmp_path_factory.mktemp("tiny"))


def test_rerank_runs_orders_the_head_by_each_term_and_keeps_the_tail(scorer: CeliScorer) -> None:
    """The one rerank loop of ``rerank evaluate`` and ``eval``: the first ``depth`` ids in
    the order of each term's scores, the rest in first-stage order after them."""
    docs = {"d0": "gamma", "d1": "alpha beta", "d2": "zeta eta", "d3": "beta", "d4": "theta"}
    first = {"q": ["d0", "d1", "d2", "d3", "d4"], "empty": []}
    runs = rerank_runs(scorer, first, {"q": "alpha beta", "empty": "x"}, docs, ["q", "empty"], 3)
    assert set(runs) == set(TERMS)
    terms = scorer.score_terms("alpha beta", ["gamma", "alpha beta", "zeta eta"])
    for name in TERMS:
        head = [["d0", "d1", "d2"][i] for i in np.argsort(-terms[name], kind="stable")]
        assert runs[name]["q"] == [*head, "d3", "d4"]
        assert runs[name]["empty"] == []
