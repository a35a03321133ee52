"""A search as one shard sees it, and its answer: plain data, no grpc, no FAISS."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from services.common.domain import Consistency, FieldCondition, WriteToken

__all__ = [
    "Consistency",
    "DenseQuery",
    "FieldCondition",
    "FilterSpec",
    "IndexQuery",
    "Probes",
    "ShardAnswer",
    "ShardQuery",
]

Scored = tuple[str, float]  # (doc id, score): a cell of a TopK grid, read back as a pair
# (key, any_of) conditions, all must hold; a FieldCondition is one
FilterSpec = Sequence[tuple[str, Sequence[str]]]


@dataclass(frozen=True, eq=False)
class Probes:
    """A coarse assignment made by the caller (:mod:`services.index.core.coarse`): per query
    row the inverted lists to scan (int64) and their coarse scores (float32), and the
    quantizer they came from."""

    quantizer: str
    lists: np.ndarray  # (rows, nprobe) int64
    scores: np.ndarray  # (rows, nprobe) float32

    @property
    def nprobe(self) -> int:
        return int(self.lists.shape[1])


@dataclass(frozen=True, eq=False)
class DenseQuery:
    """The dense part of a :class:`ShardQuery` as the shard's FAISS index runs it: the
    query vectors (``(rows, dim)``), ``k``, ``nprobe`` (0: the index's own), the filter and
    the caller's coarse assignment. The shard service hands one to its batcher
    (:class:`services.index.server.batcher.SearchBatcher`), which joins several into one."""

    vectors: np.ndarray
    k: int
    nprobe: int = 0
    filter: FilterSpec = ()
    probes: Probes | None = None


@dataclass(frozen=True)
class ShardQuery:
    shard: int
    vectors: np.ndarray
    k: int
    nprobe: int = 0
    filter: FilterSpec = ()
    consistency: Consistency = Consistency.EVENTUAL
    min_position: str = ""
    probes: Probes | None = None  # the coarse assignment, made once by the router
    # sparse (BM25): one query text per row and the depth of its list; () / 0: none.
    # ``vectors`` with no rows and ``k`` 0: a sparse-only search.
    texts: tuple[str, ...] = ()
    sparse_k: int = 0


@dataclass(frozen=True, eq=False)
class IndexQuery:
    """A search of the whole index: what the gateway's ``VectorIndex`` port takes and the
    router (:class:`services.index.client.router.ShardRouter`) fans out, one
    :class:`ShardQuery` per shard (:meth:`shard_query`).

    The dense top ``k`` of each of ``vectors`` (``(rows, dim)``) and, with ``texts`` (one
    per row) and ``sparse_k``, the BM25 top ``sparse_k`` of each text; ``vectors`` None and
    ``k`` 0: the BM25 lists only (a sparse search). ``write_token`` (SESSION): each shard
    waits for its position in it; a shard not in the token has nothing to wait for.
    ``require_complete``: a shard that does not answer fails the search instead of being
    reported missing. The time it may take is the caller's, given beside it."""

    vectors: np.ndarray | None
    k: int
    nprobe: int = 0
    filter: FilterSpec = ()
    consistency: Consistency = Consistency.EVENTUAL
    write_token: WriteToken | None = None
    require_complete: bool = False
    texts: tuple[str, ...] = ()
    sparse_k: int = 0

    @property
    def rows(self) -> int:
        """The queries of the batch."""
        return len(self.vectors) if self.vectors is not None else len(self.texts)

    def shard_query(self, shard: int, probes: Probes | None = None) -> ShardQuery:
        """This search as ``shard`` gets it: its position of the write token (SESSION
        only), the router's coarse assignment; a sparse search sends no vectors, k 0."""
        dense = self.vectors is not None
        session = self.consistency is Consistency.SESSION
        return ShardQuery(
            shard=shard,
            vectors=self.vectors if self.vectors is not None else np.zeros((0, 0), np.float32),
            k=self.k if dense else 0,
            nprobe=self.nprobe,
            filter=self.filter,
            consistency=self.consistency,
            min_position=(self.write_token or {}).get(shard, "") if session else "",
            probes=probes,
            texts=self.texts,
            sparse_k=self.sparse_k,
        )


PAD_ID = ""  # the id of an empty cell of a TopK grid (document ids are never empty)


@dataclass(frozen=True, eq=False)
class TopK:
    """The best hits of a batch of queries as a grid: one row per query, best first.

    ``ids`` is flat and row-major (``rows × width``), ``scores`` is float32
    ``(rows, width)``; a row with fewer hits is padded with :data:`PAD_ID` and -inf.
    A batch crosses the shard, the wire and the router's merge as these two arrays
    rather than as one Python object per hit (measured: the per-hit objects cost more
    than the protobuf work).
    """

    ids: list[str]
    scores: np.ndarray

    def __post_init__(self) -> None:
        if self.scores.ndim != 2 or len(self.ids) != self.scores.size:
            raise ValueError(f"TopK: {len(self.ids)} ids for scores of shape {self.scores.shape}")

    @property
    def rows(self) -> int:
        return int(self.scores.shape[0])

    @property
    def width(self) -> int:
        return int(self.scores.shape[1])

    @classmethod
    def empty(cls, rows: int, width: int) -> TopK:
        return cls([PAD_ID] * (rows * width), np.full((rows, width), -np.inf, np.float32))

    @classmethod
    def from_hits(cls, hits: Sequence[Sequence[Scored]], width: int | None = None) -> TopK:
        """The grid of per-query hit lists (tests, and answers built by hand)."""
        width = max((len(h) for h in hits), default=0) if width is None else width
        top = cls.empty(len(hits), width)
        for r, row in enumerate(hits):
            for c, (doc_id, score) in enumerate(row[:width]):
                top.ids[r * width + c] = doc_id
                top.scores[r, c] = score
        return top

    def hits(self) -> list[list[Scored]]:
        """Per query, its (doc id, score) hits, best first, without the padding."""
        w = self.width
        ids = self.ids
        return [
            [(ids[r * w + c], s) for c, s in enumerate(row) if ids[r * w + c] != PAD_ID]
            for r, row in enumerate(self.scores.tolist())
        ]

    def take(self, start: int, stop: int, width: int) -> TopK:
        """Rows ``start:stop``, their first ``width`` columns."""
        w = self.width
        width = min(width, w)
        if width == w:
            ids = self.ids[start * w : stop * w]
        else:
            ids = [i for r in range(start, stop) for i in self.ids[r * w : r * w + width]]
        return TopK(ids, self.scores[start:stop, :width])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TopK):
            return NotImplemented
        return self.ids == other.ids and np.array_equal(self.scores, other.scores)

    __hash__ = None  # type: ignore[assignment]


@dataclass
class ShardAnswer:
    """A shard's answer to one search: its hits (the :class:`TopK` grid, held as it is,
    not another form of them) and which replica answered, at which log position.

    More candidate lists of the same batch go beside ``top`` as further grids (the
    sparse list of hybrid search, issue #26), with their fields in ``ShardSearchResponse``
    and :mod:`services.index.convert`."""

    top: TopK
    shard: int
    replica: str
    applied_position: str
    sparse: TopK | None = None  # the BM25 grid, when the search asked for one
    sparse_unavailable: str = ""  # why there is none although asked (no text index)
