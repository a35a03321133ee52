"""The shared coarse quantizer: the same assignment as the IVF's own, strict checks."""

from __future__ import annotations

from typing import Any

import faiss
import numpy as np
import pytest

from services.common.errors import FailedPrecondition, InvalidArgument
from services.index.core.coarse import CoarseQuantizer
from services.index.core.query import Probes


def test_assign_matches_the_ivf_quantizer_and_preassigned_search_matches_search() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2000, 16)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    ivf: Any = faiss.index_factory(16, "IVF32,Flat", faiss.METRIC_INNER_PRODUCT)
    ivf.train(x)
    ivf.add(x)
    q = CoarseQuantizer.of_ivf(faiss.extract_index_ivf(ivf), "IP", 4)
    probes = q.assign(x[:50], 6)
    scores, lists = faiss.extract_index_ivf(ivf).quantizer.search(x[:50], 6)
    assert np.array_equal(probes.lists, lists) and np.allclose(probes.scores, scores)
    assert q.assign(x[:3]).nprobe == 4 and q.assign(x[:3], 999).nprobe == 32
    ivf.nprobe = 6
    _, i1 = ivf.search(x[:50], 5)
    _, i2 = ivf.search_preassigned(x[:50], 5, probes.lists, probes.scores)
    assert np.array_equal(i1, i2)
    assert q.id == CoarseQuantizer(q.centroids.copy(), "IP", 4).id  # a hash of the centroids


def test_check_refuses_foreign_or_malformed_probes() -> None:
    q = CoarseQuantizer(np.eye(4, dtype=np.float32), "L2", 2)
    ok = q.assign(np.eye(4, dtype=np.float32)[:2], 2)
    q.check(ok, 2)
    with pytest.raises(FailedPrecondition):
        q.check(Probes("other", ok.lists, ok.scores), 2)
    with pytest.raises(InvalidArgument, match="rows"):
        q.check(ok, 3)
    with pytest.raises(InvalidArgument, match=r"0\.\.3"):
        q.check(Probes(q.id, ok.lists + 4, ok.scores), 2)
    with pytest.raises(InvalidArgument, match="NaN"):
        q.check(Probes(q.id, ok.lists, ok.scores * np.nan), 2)
    with pytest.raises(ValueError, match="metric"):
        CoarseQuantizer(np.eye(4, dtype=np.float32), "cosine", 2)
