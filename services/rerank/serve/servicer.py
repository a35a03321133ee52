"""RerankService: proto → domain → scorer (in a worker thread) → proto."""

from __future__ import annotations

import asyncio

import grpc

from retrieval.v1 import rerank_pb2, rerank_pb2_grpc
from services.common.deadline import Deadline
from services.rerank.serve import convert
from services.rerank.serve.scorer import CeliScorer


class RerankServicer(rerank_pb2_grpc.RerankServiceServicer):
    def __init__(self, scorer: CeliScorer) -> None:
        self._scorer = scorer

    async def Rerank(
        self, request: rerank_pb2.RerankRequest, context: grpc.aio.ServicerContext
    ) -> rerank_pb2.RerankResponse:
        query = convert.query_from_pb(request)
        deadline = Deadline.after(context.time_remaining())
        result = await asyncio.to_thread(self._scorer.rerank, query, deadline)
        return convert.result_to_pb(result)
