"""IndexShardService over grpc.aio: proto → domain → ShardService → proto."""

from __future__ import annotations

import asyncio

import grpc

from retrieval.v1 import index_pb2, index_pb2_grpc
from services.index import convert
from services.index.service import ShardService


class ShardServicer(index_pb2_grpc.IndexShardServiceServicer):
    def __init__(self, service: ShardService) -> None:
        self._service = service

    async def Search(
        self, request: index_pb2.ShardSearchRequest, context: grpc.aio.ServicerContext
    ) -> index_pb2.ShardSearchResponse:
        query = convert.query_from_pb(request)
        answer = await self._service.search(query, context.time_remaining())
        return convert.answer_to_pb(answer)

    async def Stats(
        self, request: index_pb2.ShardStatsRequest, context: grpc.aio.ServicerContext
    ) -> index_pb2.ShardStats:
        replica = self._service.replica
        return convert.stats_to_pb(
            self._service.stats(),
            replica.config.shard,
            replica.config.replica,
            replica.trained.manifest,
            replica.snapshot_position,
            replica.log_lag_s,
            gpu=replica.shard.gpu is not None,
        )

    async def Snapshot(
        self, request: index_pb2.SnapshotRequest, context: grpc.aio.ServicerContext
    ) -> index_pb2.SnapshotResponse:
        snap = await asyncio.get_running_loop().run_in_executor(
            None, self._service.replica.snapshot
        )
        return index_pb2.SnapshotResponse(path=str(snap.path), position=snap.position)
