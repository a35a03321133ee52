"""The FAISS calls of a shard's search beyond ``index.search``: the scan of lists the caller
assigned (:mod:`.coarse`) and the SQ8 refine of the IVF-PQ candidates. No locking here:
the shard holds its read lock around both.
"""

from __future__ import annotations

from typing import Any

import faiss
import numpy as np

from services.index.core.query import Probes

# Candidates decoded at once by the refine: bounds its float buffer (× dim × 4 bytes) for
# the largest request (256 queries × k 1,000 × refine 4 would otherwise take 1.5 GB).
REFINE_BLOCK = 8192


def search_preassigned(
    ivf: Any, queries: np.ndarray, k: int, probes: Probes, selector: faiss.IDSelector | None
) -> tuple[np.ndarray, np.ndarray]:
    """The top-``k`` (scores, ids) of ``queries`` in the inverted lists of ``probes``."""
    # The Python wrapper of search_preassigned takes no SearchParameters (so no
    # selector and no per-call nprobe): call the C++ method directly.
    n = len(queries)
    scores = np.empty((n, k), dtype=np.float32)
    ids = np.empty((n, k), dtype=np.int64)
    lists = np.ascontiguousarray(probes.lists, dtype=np.int64)
    coarse = np.ascontiguousarray(probes.scores, dtype=np.float32)
    params = faiss.SearchParametersIVF(nprobe=probes.nprobe)  # type: ignore[call-arg]
    if selector is not None:
        params.sel = selector
    ivf.search_preassigned_c(
        n,
        faiss.swig_ptr(queries),
        k,
        faiss.swig_ptr(lists),
        faiss.swig_ptr(coarse),
        faiss.swig_ptr(scores),
        faiss.swig_ptr(ids),
        False,
        params,
    )
    return scores, ids


def refine(
    sq: Any, codes: np.ndarray, queries: np.ndarray, slots: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Re-rank the IVF-PQ candidates (a grid of slots) by their SQ8-decoded inner product
    (``codes``: the SQ8 codes by slot, ``sq`` their codec), all queries at once; the top-k
    (slots, scores) grids, -1 / -inf where fewer candidates exist. A pad is decoded as
    slot 0 and then masked: cheaper than gathering the real candidates and their queries
    apart. Large grids go by blocks of rows (:data:`REFINE_BLOCK` candidates).
    """
    n, fetch = slots.shape
    rows = max(1, REFINE_BLOCK // fetch)
    if n > rows:
        parts = [
            refine(sq, codes, queries[i : i + rows], slots[i : i + rows], k)
            for i in range(0, n, rows)
        ]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    valid = slots >= 0
    decoded = sq.decode(codes[np.maximum(slots, 0).ravel()])
    exact = np.matmul(decoded.reshape(n, fetch, queries.shape[1]), queries[:, :, None])[:, :, 0]
    exact[~valid] = -np.inf
    order = np.argsort(-exact, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(slots, order, axis=1), np.take_along_axis(exact, order, axis=1)
