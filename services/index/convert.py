"""IndexShardService protobuf ↔ domain conversions (round-trip tested)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from retrieval.v1 import common_pb2, index_pb2
from services.common.errors import InvalidArgument, Unavailable
from services.index.core.coarse import CoarseQuantizer
from services.index.core.query import Probes, ShardAnswer, ShardQuery, TopK
from services.rpc.convert import (
    consistency_from_pb,
    consistency_to_pb,
    filter_from_pb,
    filter_to_pb,
)

if TYPE_CHECKING:
    # The stats and the snapshot transfer are a shard's: they import the shard core and
    # tantivy, which the gateway, a user of this module through its router, never loads
    # (tests/unit/test_gateway_imports.py). Only annotations name them here, and
    # files_from_pb imports FileInfo where a shard calls it.
    from services.index.core.stats import ReplicaStats
    from services.index.core.transfer import FileInfo, Offer


def _f32(a: np.ndarray) -> bytes:
    """Little-endian float32 bytes: how every float array of this API travels."""
    return np.ascontiguousarray(a, dtype="<f4").tobytes()


def vectors_from_pb(batch: common_pb2.VectorBatch) -> np.ndarray:
    """The batch as a (count, dim) view of its bytes; InvalidArgument when the bytes do
    not make one. How many vectors a search may take is the shard's check
    (:meth:`IvfPqShard.check`), not repeated here."""
    if batch.dim == 0 or batch.count == 0:
        raise InvalidArgument("queries: dim and count must be positive")
    expected = 4 * batch.dim * batch.count
    if len(batch.data) != expected:
        raise InvalidArgument(
            f"queries: {len(batch.data)} bytes of data, expected 4 × dim × count = {expected}"
        )
    return np.frombuffer(batch.data, dtype="<f4").reshape(batch.count, batch.dim)


def vectors_to_pb(vectors: np.ndarray) -> common_pb2.VectorBatch:
    return common_pb2.VectorBatch(data=_f32(vectors), dim=vectors.shape[1], count=vectors.shape[0])


def probes_to_pb(p: Probes) -> index_pb2.Probes:
    return index_pb2.Probes(
        quantizer=p.quantizer,
        nprobe=p.nprobe,
        lists=np.ascontiguousarray(p.lists, dtype="<i8").tobytes(),
        scores=_f32(p.scores),
    )


def probes_from_pb(p: index_pb2.Probes, rows: int) -> Probes:
    expected = rows * p.nprobe
    if p.nprobe == 0 or len(p.lists) != 8 * expected or len(p.scores) != 4 * expected:
        raise InvalidArgument(
            f"probes: {len(p.lists)} + {len(p.scores)} bytes for {rows} queries × nprobe "
            f"{p.nprobe}, expected 8 and 4 bytes per probe"
        )
    return Probes(
        quantizer=p.quantizer,
        lists=np.frombuffer(p.lists, dtype="<i8").reshape(rows, p.nprobe),
        scores=np.frombuffer(p.scores, dtype="<f4").reshape(rows, p.nprobe),
    )


def query_from_pb(req: index_pb2.ShardSearchRequest) -> ShardQuery:
    sparse_only = req.k == 0 and req.sparse_k > 0 and not req.queries.count
    vectors = np.zeros((0, 0), np.float32) if sparse_only else vectors_from_pb(req.queries)
    return ShardQuery(
        shard=req.shard,
        vectors=vectors,
        k=req.k,
        nprobe=req.nprobe,
        filter=filter_from_pb(req.filter),
        consistency=consistency_from_pb(req.consistency),
        min_position=req.min_position,
        probes=probes_from_pb(req.probes, len(vectors)) if req.HasField("probes") else None,
        texts=tuple(req.texts),
        sparse_k=req.sparse_k,
    )


def query_to_pb(q: ShardQuery) -> index_pb2.ShardSearchRequest:
    return index_pb2.ShardSearchRequest(
        shard=q.shard,
        queries=vectors_to_pb(q.vectors),
        k=q.k,
        nprobe=q.nprobe,
        filter=filter_to_pb(q.filter),
        consistency=consistency_to_pb(q.consistency),
        min_position=q.min_position,
        probes=probes_to_pb(q.probes) if q.probes is not None else None,
        texts=q.texts,
        sparse_k=q.sparse_k,
    )


def answer_to_pb(
    a: ShardAnswer, out: index_pb2.ShardSearchResponse | None = None
) -> index_pb2.ShardSearchResponse:
    """The answer as a message; ``out``: the message to fill, in place (a stream
    response's ``result``: built there once rather than built and then copied in)."""
    out = index_pb2.ShardSearchResponse() if out is None else out
    out.width = a.top.width
    out.ids.extend(a.top.ids)
    out.scores = _f32(a.top.scores)
    out.shard = a.shard
    out.replica = a.replica
    out.applied_position = a.applied_position
    if a.sparse is not None:
        out.sparse_width = a.sparse.width
        out.sparse_ids.extend(a.sparse.ids)
        out.sparse_scores = _f32(a.sparse.scores)
    out.sparse_unavailable = a.sparse_unavailable
    return out


def _grid(r: index_pb2.ShardSearchResponse, ids: list[str], data: bytes, width: int) -> TopK:
    """A grid of the answer; Unavailable when it does not add up (a broken replica)."""
    if 4 * len(ids) != len(data) or (ids and (width == 0 or len(ids) % width)):
        raise Unavailable(
            f"shard {r.shard} replica {r.replica}: malformed answer "
            f"({len(ids)} ids, {len(data)} score bytes, width {width})"
        )
    if ids:
        return TopK(ids, np.frombuffer(data, dtype="<f4").reshape(-1, width))
    return TopK(ids, np.zeros((0, width), np.float32))


def answer_from_pb(r: index_pb2.ShardSearchResponse) -> ShardAnswer:
    """The answer; Unavailable when a grid does not add up (a broken replica)."""
    sparse = None
    if r.sparse_width or r.sparse_ids:
        sparse = _grid(r, list(r.sparse_ids), r.sparse_scores, r.sparse_width)
    return ShardAnswer(
        top=_grid(r, list(r.ids), r.scores, r.width),
        shard=r.shard,
        replica=r.replica,
        applied_position=r.applied_position,
        sparse=sparse,
        sparse_unavailable=r.sparse_unavailable,
    )


def stats_to_pb(r: ReplicaStats) -> index_pb2.ShardStats:
    s, m = r.index, r.manifest
    return index_pb2.ShardStats(
        shard=r.shard,
        replica=r.replica,
        dim=m.dim,
        factory=m.factory,
        metric=m.metric,
        model=m.model,
        nlist=m.nlist,
        vectors=s.vectors,
        deleted=s.deleted,
        applied_position=s.applied_position,
        log_lag_seconds=r.log_lag_s,
        bytes_per_vector=s.bytes_per_vector,
        memory_bytes=s.memory_bytes,
        train_pq_error=s.train_pq_error,
        recent_pq_error=s.recent_pq_error,
        pq_error_ratio=s.pq_error_ratio,
        list_imbalance=s.list_imbalance,
        snapshot_position=r.snapshot_position,
        gpu=r.gpu,
        nprobe=m.nprobe,
        target_recall=m.target_recall or 0.0,
        measured_recall=m.measured_recall or 0.0,
        ivf_advice=m.ivf_advice or "",
        searches=r.searches,
        text_index=s.text is not None,
        text_documents=s.text.documents if s.text is not None else 0,
        text_disk_bytes=(s.text.disk_bytes or 0) if s.text is not None else 0,  # 0: unread
        generation=r.generation,
    )


def offer_to_pb(offer: Offer) -> index_pb2.SnapshotChunk:
    """The first message of a snapshot transfer: position and files."""
    return index_pb2.SnapshotChunk(
        position=offer.position,
        files=[
            index_pb2.SnapshotFile(name=f.name, size=f.size, sha256=f.sha256, index=f.index)
            for f in offer.files
        ],
    )


def files_from_pb(first: index_pb2.SnapshotChunk) -> list[FileInfo]:
    from services.index.core.transfer import FileInfo

    return [FileInfo(f.name, f.size, f.sha256, f.index) for f in first.files]


def quantizer_to_pb(q: CoarseQuantizer) -> index_pb2.QuantizerReply:
    return index_pb2.QuantizerReply(
        id=q.id,
        dim=q.dim,
        nlist=q.nlist,
        metric=q.metric,
        nprobe=q.default_nprobe,
        centroids=_f32(q.centroids),
    )


def quantizer_from_pb(r: index_pb2.QuantizerReply) -> CoarseQuantizer:
    if r.dim == 0 or len(r.centroids) != 4 * r.dim * r.nlist:
        raise Unavailable(f"quantizer: {len(r.centroids)} bytes for {r.nlist} × {r.dim}")
    centroids = np.frombuffer(r.centroids, dtype="<f4").reshape(r.nlist, r.dim)
    try:
        quantizer = CoarseQuantizer(centroids, r.metric, r.nprobe)
    except ValueError as exc:
        raise Unavailable(f"quantizer: {exc}") from None
    if quantizer.id != r.id:
        raise Unavailable(f"quantizer: centroids do not hash to their id {r.id!r}")
    return quantizer


EXPORT_DEFAULT_BYTES = 2 << 20  # vectors of a VectorChunk when the request names no batch
EXPORT_MAX_BYTES = 8 << 20
EXPORT_MAX_BATCH = 65536


def export_batch(requested: int, dim: int) -> int:
    """Vectors per ExportVectors message: ``requested``, or as many as fit in 2 MiB when
    0; InvalidArgument past 65,536 or 8 MiB a message."""
    if requested == 0:
        return max(1, EXPORT_DEFAULT_BYTES // (4 * dim))
    if requested > EXPORT_MAX_BATCH or 4 * dim * requested > EXPORT_MAX_BYTES:
        raise InvalidArgument(
            f"batch: {requested} vectors of dimension {dim} a message, takes at most "
            f"{min(EXPORT_MAX_BATCH, EXPORT_MAX_BYTES // (4 * dim))}"
        )
    return requested


def vector_chunk_to_pb(
    ids: list[str], vectors: np.ndarray, position: str, shard: int, generation: str
) -> index_pb2.VectorChunk:
    return index_pb2.VectorChunk(
        ids=ids,
        vectors=vectors_to_pb(vectors),
        position=position,
        shard=shard,
        generation=generation,
    )


def vector_chunk_from_pb(chunk: index_pb2.VectorChunk) -> tuple[list[str], np.ndarray, str]:
    """(ids, float32 (n, dim) vectors, position) of one ExportVectors message."""
    batch = chunk.vectors
    if batch.count == 0:
        vectors = np.zeros((0, batch.dim), dtype=np.float32)
    else:
        vectors = vectors_from_pb(batch)
    if len(vectors) != len(chunk.ids):
        raise InvalidArgument(f"{len(chunk.ids)} ids for {len(vectors)} vectors")
    return list(chunk.ids), vectors, chunk.position
