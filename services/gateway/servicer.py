"""The public gRPC servicers: proto → domain → pipeline → proto, nothing else."""

from __future__ import annotations

import asyncio

import grpc

from retrieval.v1 import documents_pb2, documents_pb2_grpc, search_pb2, search_pb2_grpc
from services.gateway import convert
from services.gateway.document_pipeline import DocumentPipeline
from services.gateway.pipeline import SearchPipeline

# A search takes one unit of the in-flight limit per this many hits it may return or
# rerank (k or the rerank depth, summed over a batch): k <= 25 takes one, k = 100 four,
# k = 1000 forty (at most the whole limit: alone). Measured (bench.overload, 1,000
# concurrent calls, limit 32, 1.5 s deadline): 32 searches of 10 hits or one of 1,000 in
# flight leave the event loop free to refuse the rest within ~0.3 s; three of 1,000 (at
# 100 hits per unit) did not (52-182 of 1,000 DEADLINE_EXCEEDED, refusals at ~1.5 s).
HITS_PER_UNIT = 25
# Answers with more hits than this are converted to protobuf in a worker thread: 1,000
# hits with their documents hold the event loop for milliseconds, during which gRPC
# accepts no new call (so none can be refused either).
CONVERT_OFF_LOOP_HITS = 100


def admission_cost(request: object) -> int:
    """The units of ``--max-in-flight`` a call takes (Admission's ``cost``): searches by
    their hits, as the document fetch, conversion and answer grow with them; any other
    call one."""
    if isinstance(request, search_pb2.SearchRequest):
        searches = [request]
    elif isinstance(request, search_pb2.BatchSearchRequest):
        searches = list(request.requests)
    else:
        return 1
    hits = sum(max(r.k, r.rerank.depth if r.rerank.enabled else 0) for r in searches)
    return max(1, -(-hits // HITS_PER_UNIT))


class SearchServicer(search_pb2_grpc.SearchServiceServicer):
    def __init__(self, pipeline: SearchPipeline) -> None:
        self._pipeline = pipeline

    async def Search(
        self, request: search_pb2.SearchRequest, context: grpc.aio.ServicerContext
    ) -> search_pb2.SearchResponse:
        query = convert.query_from_pb(request)
        result = await self._pipeline.search(query, context.time_remaining())
        if len(result.hits) > CONVERT_OFF_LOOP_HITS:
            return await asyncio.to_thread(convert.result_to_pb, result)
        return convert.result_to_pb(result)

    async def BatchSearch(
        self, request: search_pb2.BatchSearchRequest, context: grpc.aio.ServicerContext
    ) -> search_pb2.BatchSearchResponse:
        queries = [convert.query_from_pb(r) for r in request.requests]
        results = await self._pipeline.search_batch(queries, context.time_remaining())
        return search_pb2.BatchSearchResponse(responses=[convert.result_to_pb(r) for r in results])


class DocumentServicer(documents_pb2_grpc.DocumentServiceServicer):
    def __init__(self, pipeline: DocumentPipeline) -> None:
        self._pipeline = pipeline

    async def Upsert(
        self, request: documents_pb2.UpsertRequest, context: grpc.aio.ServicerContext
    ) -> documents_pb2.UpsertResponse:
        docs = [convert.document_from_pb(d) for d in request.documents]
        result = await self._pipeline.upsert(docs, context.time_remaining())
        return convert.upsert_result_to_pb(result)

    async def Delete(
        self, request: documents_pb2.DeleteRequest, context: grpc.aio.ServicerContext
    ) -> documents_pb2.DeleteResponse:
        result = await self._pipeline.delete(list(request.ids), context.time_remaining())
        return convert.delete_result_to_pb(result)

    async def Get(
        self, request: documents_pb2.GetRequest, context: grpc.aio.ServicerContext
    ) -> documents_pb2.GetResponse:
        doc = await self._pipeline.get(request.id, context.time_remaining())
        return documents_pb2.GetResponse(document=convert.document_to_pb(doc))
