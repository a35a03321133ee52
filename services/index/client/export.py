"""The vectors a shard replica holds, read over its ``ExportVectors`` RPC (issue #24).

A rollout with ``--retrain`` (docs/generations.md) trains the next generation's quantizer
on the vectors the serving generation already stores instead of re-embedding every
document: :func:`export_vectors` streams them from one replica of each shard. They are
decoded from the replica's SQ8 refine codes (8 bits per dimension over the range trained
per dimension), so each value is within half a quantization step of what was upserted;
what that costs in recall is measured by the rollout's benchmark, not assumed here.

Each chunk says the log position the whole export stands at (the replica's applied
position when it copied its codes): every change of the shard's log up to it is in the
export, none after it, so a builder replays the log from there.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import numpy as np

from retrieval.v1 import index_pb2, index_pb2_grpc
from services.index import convert
from services.rpc.status import error_from_rpc
from services.rpc.tls import ClientTLS, aio_channel

# A message carries at most 8 MiB of vectors (convert.EXPORT_MAX_BYTES), plus its ids.
MAX_MESSAGE_BYTES = 64 << 20


async def export_vectors(
    address: str,
    tls: ClientTLS | None = None,
    *,
    batch: int = 0,
    timeout: float | None = None,
) -> AsyncIterator[tuple[list[str], np.ndarray, str]]:
    """Every (ids, float32 (n, dim) vectors, position) chunk of the replica at
    ``address``; ``batch``: vectors per chunk (0: as many as fit in 2 MiB). The domain
    error of a failed call (Unavailable while the replica is not serving, or cannot be
    reached; DeadlineExceeded past ``timeout``)."""
    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
    async with aio_channel(address, tls, options) as channel:
        stub = index_pb2_grpc.IndexShardServiceStub(channel)
        call = stub.ExportVectors(index_pb2.ExportVectorsRequest(batch=batch), timeout=timeout)
        try:
            async for chunk in call:
                yield convert.vector_chunk_from_pb(chunk)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc, f"shard replica {address}") from exc
