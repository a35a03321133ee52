"""Fusion of a dense and a sparse candidate list into one ranking (hybrid retrieval).

- **RRF** (reciprocal-rank fusion, Cormack et al. 2009): score = Σ 1 / (k + rank) over
  the lists a document is in (rank from 1); ``k`` 60 by default, the paper's and what
  Elasticsearch, Qdrant and Milvus default to. Uses only ranks, so BM25's unbounded
  scores and cosine similarities need no calibration.
- **Weighted**: each list's scores min-max normalised to [0, 1] over that list, then
  ``dense_weight × dense + (1 − dense_weight) × sparse`` (0 for a list the document is
  not in): the "convex combination" of Bruch et al. 2023 and Weaviate's
  ``relativeScoreFusion``.

Ties keep dense-list order first, then sparse. Pure functions: the gateway fuses the
shards' merged lists with them and ``gtr-retrieval eval`` its in-process runs, so both
rank alike.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

from services.common.domain import Hit
from services.common.errors import InvalidArgument

DEFAULT_RRF_K = 60
MAX_RRF_K = 10_000


class Mode(enum.Enum):
    DENSE = "dense"
    SPARSE = "sparse"
    HYBRID = "hybrid"


class Method(enum.Enum):
    RRF = "rrf"
    WEIGHTED = "weighted"


@dataclass(frozen=True)
class Fusion:
    method: Method = Method.RRF
    rrf_k: int = DEFAULT_RRF_K
    dense_weight: float = 0.5  # WEIGHTED: the dense share; the sparse one is 1 − it

    def __post_init__(self) -> None:
        if not 1 <= self.rrf_k <= MAX_RRF_K:
            raise InvalidArgument(f"fusion rrf_k: {self.rrf_k} is out of range 1..{MAX_RRF_K}")
        if not (math.isfinite(self.dense_weight) and 0.0 <= self.dense_weight <= 1.0):
            raise InvalidArgument(f"fusion dense_weight: {self.dense_weight} is not in [0, 1]")


@dataclass(frozen=True)
class RetrievalDefaults:
    """What a search that names no mode or fusion gets (the gateway's settings).

    Hybrid with the weighted fusion: on SciFact's dev queries it was the only system
    above both dense and BM25 alone (docs/index.md, "Text index"). ``candidates``: hits
    taken from each list before fusing (the evaluation fused the top 100 of each).
    """

    mode: Mode = Mode.HYBRID
    fusion: Fusion = Fusion(Method.WEIGHTED)
    candidates: int = 100


Scored = tuple[str, float]


def _normalised(hits: Sequence[Hit]) -> dict[str, float]:
    if not hits:
        return {}
    scores = [h.score for h in hits]
    low, high = min(scores), max(scores)
    span = high - low
    return {h.id: (h.score - low) / span if span > 0 else 1.0 for h in hits}


def fuse_hits(dense: Sequence[Hit], sparse: Sequence[Hit], fusion: Fusion, k: int) -> list[Hit]:
    """The top ``k`` of the two lists (each best first) fused by ``fusion``: each a copy of
    its hit (the dense list's when it is in both) with ``score`` and ``first_stage_score``
    the fused score and ``dense_rank`` / ``sparse_rank`` its 1-based ranks (0: not in
    that list). They stay :class:`Hit` objects: fusing adds no form of a hit."""
    dense_rank = {h.id: r for r, h in enumerate(dense, 1)}
    sparse_rank = {h.id: r for r, h in enumerate(sparse, 1)}
    hit = {h.id: h for h in sparse} | {h.id: h for h in dense}
    order = list(dict.fromkeys([h.id for h in dense] + [h.id for h in sparse]))
    if fusion.method is Method.RRF:
        c = fusion.rrf_k
        scores = {
            d: (1.0 / (c + dense_rank[d]) if d in dense_rank else 0.0)
            + (1.0 / (c + sparse_rank[d]) if d in sparse_rank else 0.0)
            for d in order
        }
    else:
        w = fusion.dense_weight
        nd, ns = _normalised(dense), _normalised(sparse)
        scores = {d: w * nd.get(d, 0.0) + (1.0 - w) * ns.get(d, 0.0) for d in order}
    position = {d: i for i, d in enumerate(order)}
    ranked = sorted(order, key=lambda d: (-scores[d], position[d]))[:k]
    return [
        dataclasses.replace(
            hit[d],
            score=scores[d],
            first_stage_score=scores[d],
            dense_rank=dense_rank.get(d, 0),
            sparse_rank=sparse_rank.get(d, 0),
        )
        for d in ranked
    ]


def fuse(dense: Sequence[Scored], sparse: Sequence[Scored], fusion: Fusion, k: int) -> list[Hit]:
    """:func:`fuse_hits` of (doc id, score) lists (evaluation runs, benches): hits of no
    particular shard (0)."""
    return fuse_hits(
        [Hit(d, s, 0, s) for d, s in dense], [Hit(d, s, 0, s) for d, s in sparse], fusion, k
    )
