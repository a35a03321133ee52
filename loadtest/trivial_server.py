"""A trivial gRPC server with the gateway's API, to measure the load generator itself.

Search, BatchSearch and Upsert answer an empty response at once (no encoder, no index),
so whatever latency and ceiling the generator reports against it is the generator's and
the gRPC stack's own cost: the floor under every figure it reports against the gateway.
``on_request`` is a hook the tests use to make it stall or fail (a real server misbehaving
on purpose); the command line runs it bare in a process of its own:

    python -m loadtest.trivial_server --port 0     # prints "listening on 127.0.0.1:PORT"
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from retrieval.v1 import documents_pb2, documents_pb2_grpc, search_pb2, search_pb2_grpc

# Called with each search request before the empty answer; a message it returns is the
# answer instead (tests: a partial result), an abort it makes is the status.
Hook = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]


class TrivialSearch(search_pb2_grpc.SearchServiceServicer):
    def __init__(self, on_request: Hook | None = None) -> None:
        self.on_request = on_request
        self.calls = 0

    async def Search(
        self, request: search_pb2.SearchRequest, context: grpc.aio.ServicerContext
    ) -> search_pb2.SearchResponse:
        self.calls += 1
        if self.on_request is not None and (reply := await self.on_request(request, context)):
            return reply  # type: ignore[no-any-return]
        return search_pb2.SearchResponse()

    async def BatchSearch(
        self, request: search_pb2.BatchSearchRequest, context: grpc.aio.ServicerContext
    ) -> search_pb2.BatchSearchResponse:
        self.calls += 1
        if self.on_request is not None and (reply := await self.on_request(request, context)):
            return reply  # type: ignore[no-any-return]
        empty = [search_pb2.SearchResponse() for _ in request.requests]
        return search_pb2.BatchSearchResponse(responses=empty)


class TrivialDocuments(documents_pb2_grpc.DocumentServiceServicer):
    async def Upsert(
        self, request: documents_pb2.UpsertRequest, context: grpc.aio.ServicerContext
    ) -> documents_pb2.UpsertResponse:
        return documents_pb2.UpsertResponse(upserted=len(request.documents))

    async def Delete(
        self, request: documents_pb2.DeleteRequest, context: grpc.aio.ServicerContext
    ) -> documents_pb2.DeleteResponse:
        return documents_pb2.DeleteResponse(not_found=list(request.ids))

    async def Get(
        self, request: documents_pb2.GetRequest, context: grpc.aio.ServicerContext
    ) -> documents_pb2.GetResponse:
        await context.abort(grpc.StatusCode.NOT_FOUND, f"no document {request.id!r}")
        raise AssertionError("abort raises")


async def start_trivial_server(
    port: int = 0,
    on_request: Hook | None = None,
    host: str = "127.0.0.1",
    credentials: grpc.ServerCredentials | None = None,
) -> tuple[grpc.aio.Server, int, TrivialSearch]:
    """A started server on ``host:port`` (0: a free port) → (server, port, servicer);
    TLS with ``credentials``."""
    server = grpc.aio.server()
    servicer = TrivialSearch(on_request)
    search_pb2_grpc.add_SearchServiceServicer_to_server(servicer, server)
    documents_pb2_grpc.add_DocumentServiceServicer_to_server(TrivialDocuments(), server)
    if credentials is None:
        bound = server.add_insecure_port(f"{host}:{port}")
    else:
        bound = server.add_secure_port(f"{host}:{port}", credentials)
    await server.start()
    return server, bound, servicer


def serial(service_s: float) -> Hook:
    """One search at a time, ``service_s`` each: a server of capacity 1/service_s per
    second (the sweep tests' server)."""
    lock = asyncio.Lock()

    async def one_at_a_time(request: Any, context: grpc.aio.ServicerContext) -> None:
        async with lock:
            await asyncio.sleep(service_s)

    return one_at_a_time


async def _serve(port: int, service_ms: float) -> None:
    hook = serial(service_ms / 1000.0) if service_ms > 0 else None
    server, bound, _ = await start_trivial_server(port, hook)
    print(f"listening on 127.0.0.1:{bound}", flush=True)
    await server.wait_for_termination()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--port", type=int, default=0, help="0: a free port (printed)")
    parser.add_argument(
        "--service-ms",
        type=float,
        default=0.0,
        help="answer one search at a time, this long each (0: at once, concurrently)",
    )
    args = parser.parse_args(argv)
    asyncio.run(_serve(args.port, args.service_ms))


if __name__ == "__main__":
    main()
