"""IndexShardService over grpc.aio: proto → domain → ShardService → proto."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
import numpy as np

from retrieval.v1 import index_pb2, index_pb2_grpc
from services.common.errors import RetrievalError
from services.common.parking import parked
from services.common.positions import Position
from services.index import convert
from services.index.server.service import ShardService
from services.rpc.admission import Admission
from services.rpc.status import status_number
from services.telemetry import tracing

log = logging.getLogger(__name__)

# A Stats call that waits for a position stops waiting this long (at most a tenth of its
# time) before its deadline: its DEADLINE_EXCEEDED names what the replica applied.
ANSWER_RESERVE_S = 0.05


# The span of one search that came as a message of a SearchStream (the stream itself, a
# long-lived call, has none).
STREAM_SEARCH = "retrieval.v1.IndexShardService/SearchStream search"


def _incoming(msg: index_pb2.ShardStreamRequest) -> tracing.Incoming | None:
    """The caller's trace context, carried in the message (a stream has no metadata per
    search)."""
    if not msg.traceparent or not tracing.enabled():
        return None
    return tracing.Incoming(msg.traceparent, msg.tracestate)


class ShardServicer(index_pb2_grpc.IndexShardServiceServicer):
    """``admission``: the server's in-flight limit. A unary call is admitted by the
    interceptor; a ``SearchStream`` is one long call, so each of its searches is admitted
    here (over the limit it answers RESOURCE_EXHAUSTED for itself and the router asks
    another replica).

    :meth:`drain` (the server's stop begins) ends every ``SearchStream`` once its running
    searches have answered: a stream is one call that the router keeps open for as long as
    the replica runs, so without it the server's drain always lasted its whole grace (5 s
    per shard process; ``up`` stopped a stack's shards one after the other) and ended with
    the streams cancelled. The router takes a stream's end as UNAVAILABLE for whatever it
    still waits on, and asks the shard's next replica."""

    def __init__(self, service: ShardService, admission: Admission | None = None) -> None:
        self._service = service
        self._admission = admission or Admission()
        self._draining = False
        self._readers: set[asyncio.Task[None]] = set()  # streams still taking searches

    def drain(self) -> None:
        """Take no more searches on any stream; each ends once its running ones answered."""
        self._draining = True
        for reader in list(self._readers):
            reader.cancel()

    async def Search(
        self, request: index_pb2.ShardSearchRequest, context: grpc.aio.ServicerContext
    ) -> index_pb2.ShardSearchResponse:
        answer = await self._service.search(
            convert.query_from_pb(request), context.time_remaining()
        )
        return convert.answer_to_pb(answer)

    async def SearchStream(
        self,
        requests: AsyncIterator[index_pb2.ShardStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[index_pb2.ShardStreamResponse]:
        """Every request runs as its own task (so they batch like unary calls); answers go
        out as they complete. At the end of the input, in-flight searches finish first."""
        out: asyncio.Queue[index_pb2.ShardStreamResponse | None] = asyncio.Queue()
        running: set[asyncio.Task[None]] = set()

        async def one(msg: index_pb2.ShardStreamRequest) -> None:
            try:
                timeout = msg.timeout_us / 1e6 if msg.timeout_us else None
                with (
                    tracing.server_span(STREAM_SEARCH, _incoming(msg)),
                    self._admission.admit(),
                ):
                    answer = await self._service.search(convert.query_from_pb(msg.search), timeout)
                reply = index_pb2.ShardStreamResponse(tag=msg.tag)
                convert.answer_to_pb(answer, reply.result)  # filled in place, not copied in
                out.put_nowait(reply)
            except Exception as exc:  # each search answers for itself; the stream goes on
                if not isinstance(exc, RetrievalError):
                    log.exception("unhandled error in a streamed search")
                code, message = status_number(exc)
                out.put_nowait(
                    index_pb2.ShardStreamResponse(
                        tag=msg.tag, status_code=code, status_message=message
                    )
                )

        async def read() -> None:
            try:
                try:
                    async for msg in requests:
                        task = asyncio.ensure_future(one(msg))
                        running.add(task)
                        task.add_done_callback(running.discard)
                except asyncio.CancelledError:
                    if not self._draining:
                        raise
                    current = asyncio.current_task()
                    if current is not None:
                        current.uncancel()  # the searches below still run
                finally:
                    self._readers.discard(reader)
                while running:
                    await asyncio.gather(*running)
            finally:
                out.put_nowait(None)

        if self._draining:  # opened as the server stops: it takes nothing
            return
        reader = asyncio.ensure_future(read())

        def ended(task: asyncio.Task[None]) -> None:
            if task.cancelled():  # by :meth:`drain` before its first step: no ``finally`` ran
                out.put_nowait(None)

        reader.add_done_callback(ended)
        self._readers.add(reader)
        try:
            while (reply := await out.get()) is not None:
                yield reply
            if not reader.cancelled():
                await reader  # re-raises a failed read (e.g. a malformed message)
        finally:
            reader.cancel()
            for task in list(running):
                task.cancel()

    async def Quantizer(
        self, request: index_pb2.QuantizerRequest, context: grpc.aio.ServicerContext
    ) -> index_pb2.QuantizerReply:
        return convert.quantizer_to_pb(self._service.replica.shard.quantizer)

    async def Stats(
        self, request: index_pb2.ShardStatsRequest, context: grpc.aio.ServicerContext
    ) -> index_pb2.ShardStats:
        if request.applied_at_least:  # a waiting call does no work: its unit lent back
            wanted = Position.parse(request.applied_at_least)
            # a call without a deadline waits as long as a search without one would
            left = context.time_remaining()
            left = self._service.default_timeout_s if left is None else left
            # ...and ends before the caller's deadline, so that the caller reads why
            wait = max(0.0, left - min(ANSWER_RESERVE_S, left / 10))
            with parked():
                await self._service.replica.wait_for(wanted, wait)
        return convert.stats_to_pb(self._service.replica_stats())

    async def Snapshot(
        self, request: index_pb2.SnapshotRequest, context: grpc.aio.ServicerContext
    ) -> index_pb2.SnapshotResponse:
        """A snapshot of at least every change written to the log before this call: the
        replica first applies the log up to its end as read now (like a STRONG search),
        then writes the snapshot and trims the log below the oldest replica's. Without
        the wait, a replica still applying recent writes (each batch also commits the
        text index) snapshotted an older position, so the trim freed nothing and the
        snapshot missed acknowledged writes. DEADLINE_EXCEEDED when the call's deadline
        passes first, UNAVAILABLE when the log cannot be read."""
        replica = self._service.replica
        await replica.wait_for(await replica.tail(), context.time_remaining())
        snap = await asyncio.get_running_loop().run_in_executor(None, replica.snapshot)
        return index_pb2.SnapshotResponse(path=str(snap.path), position=snap.position)

    async def FetchSnapshot(
        self, request: index_pb2.FetchSnapshotRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[index_pb2.SnapshotChunk]:
        """The newest snapshot for a peer: the file list, then each file in chunks (read
        in a thread, one chunk at a time, so searches go on meanwhile)."""
        loop = asyncio.get_running_loop()
        offer = await loop.run_in_executor(
            None,
            self._service.snapshot_offer,
            request.shard,
            request.with_index,
            request.generation,
        )
        log.info(
            "sending snapshot %s (%d bytes) to %s",
            offer.position,
            sum(f.size for f in offer.files),
            request.replica or "a peer",
        )
        try:
            yield convert.offer_to_pb(offer)
            chunks = offer.chunks()
            while (chunk := await loop.run_in_executor(None, next, chunks, None)) is not None:
                file, offset, data = chunk
                yield index_pb2.SnapshotChunk(file=file, offset=offset, data=data)
        finally:
            offer.close()

    async def ExportVectors(
        self, request: index_pb2.ExportVectorsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[index_pb2.VectorChunk]:
        """Every (id, vector) this replica holds, at one position: the ids and SQ8 codes
        are copied at once, then decoded and sent a chunk at a time (decoded in a thread,
        so searches go on meanwhile)."""
        loop = asyncio.get_running_loop()
        export = await loop.run_in_executor(None, self._service.export)
        batch = convert.export_batch(request.batch, export.codes.shape[1])
        replica = self._service.replica
        log.info("exporting %d vectors at %s", len(export), export.position)
        for start in range(0, len(export), batch):
            stop = min(start + batch, len(export))
            vectors = await loop.run_in_executor(None, export.vectors, start, stop)
            yield convert.vector_chunk_to_pb(
                export.ids[start:stop],
                vectors,
                export.position,
                replica.config.shard,
                replica.generation,
            )
        if not len(export):  # an empty shard still says where it stands
            yield convert.vector_chunk_to_pb(
                [],
                np.zeros((0, export.codes.shape[1]), np.float32),
                export.position,
                replica.config.shard,
                replica.generation,
            )
