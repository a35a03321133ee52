"""The paired comparison that says whether a reranker's gain over dense is more than noise."""

from __future__ import annotations

import numpy as np
import pytest

from services.common.errors import InvalidArgument
from services.rerank.train.evaluate import paired_comparison


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
