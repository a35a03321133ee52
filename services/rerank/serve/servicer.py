"""RerankService: proto → domain → the scorer of the checkpoint it names → proto (the
lookup, a load on first use, and the scoring in a worker thread)."""

from __future__ import annotations

import asyncio

import grpc

from retrieval.v1 import rerank_pb2, rerank_pb2_grpc
from services.common.deadline import Deadline
from services.rerank.domain import RerankQuery, RerankResult
from services.rerank.serve import convert
from services.rerank.serve.pool import ScorerPool


class RerankServicer(rerank_pb2_grpc.RerankServiceServicer):
    def __init__(self, pool: ScorerPool) -> None:
        self._pool = pool

    async def Rerank(
        self, request: rerank_pb2.RerankRequest, context: grpc.aio.ServicerContext
    ) -> rerank_pb2.RerankResponse:
        query = convert.query_from_pb(request)
        deadline = Deadline.after(context.time_remaining())
        result = await asyncio.to_thread(self._rerank, query, deadline)
        return convert.result_to_pb(result)

    def _rerank(self, query: RerankQuery, deadline: Deadline) -> RerankResult:
        return self._pool.get(query.checkpoint).rerank(query, deadline)
