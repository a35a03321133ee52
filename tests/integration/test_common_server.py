"""The shared server bootstrap: a real grpc.aio server on a free port."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, generate_latest

from retrieval.v1 import rerank_pb2, rerank_pb2_grpc
from services.common import errors
from services.rpc.metrics import RpcMetrics
from services.rpc.server import create_server
from services.rpc.settings import ServiceSettings

RAISES: dict[str, Exception] = {
    "invalid": errors.InvalidArgument("query: must not be empty"),
    "missing": errors.NotFound("document 'x' does not exist"),
    "busy": errors.Overloaded("queue full"),
    "down": errors.Unavailable("redis unreachable"),
    "late": errors.DeadlineExceeded("deadline exceeded before search"),
    "bug": RuntimeError("boom"),
}


class _Echo(rerank_pb2_grpc.RerankServiceServicer):
    def __init__(self) -> None:
        self.inner: grpc.aio.Channel | None = None  # a channel to a server that never answers
        self.calling = asyncio.Event()  # an inner call is in flight

    async def Rerank(self, request: Any, context: Any) -> rerank_pb2.RerankResponse:
        if request.query in RAISES:
            raise RAISES[request.query]
        if request.query == "inner" and self.inner is not None:
            call = self.inner.unary_unary("/never.Answers/Call")(b"", timeout=60)
            self.calling.set()
            await call  # its channel closed under it: grpc.aio raises CancelledError here
        return rerank_pb2.RerankResponse(model=request.query)


async def _with_server(body: Any, echo: _Echo | None = None) -> CollectorRegistry:
    registry = CollectorRegistry()

    def register(server: grpc.aio.Server) -> list[str]:
        rerank_pb2_grpc.add_RerankServiceServicer_to_server(echo or _Echo(), server)
        return ["retrieval.v1.RerankService"]

    server, port = await create_server(
        ServiceSettings(), register, RpcMetrics.create(registry, "test")
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await body(channel)
    finally:
        await server.stop(0.5)
    return registry


@pytest.mark.parametrize(
    ("query", "code"),
    [
        ("invalid", grpc.StatusCode.INVALID_ARGUMENT),
        ("missing", grpc.StatusCode.NOT_FOUND),
        ("busy", grpc.StatusCode.RESOURCE_EXHAUSTED),
        ("down", grpc.StatusCode.UNAVAILABLE),
        ("late", grpc.StatusCode.DEADLINE_EXCEEDED),
        ("bug", grpc.StatusCode.INTERNAL),
    ],
)
def test_domain_errors_map_to_status_codes(query: str, code: grpc.StatusCode) -> None:
    async def body(channel: grpc.aio.Channel) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await rerank_pb2_grpc.RerankServiceStub(channel).Rerank(
                rerank_pb2.RerankRequest(query=query)
            )
        assert err.value.code() == code
        if code != grpc.StatusCode.INTERNAL:
            assert err.value.details() == str(RAISES[query])

    asyncio.run(_with_server(body))


def test_an_inner_call_cancelled_under_a_handler_answers_unavailable_at_once() -> None:
    """A handler's own call to another server is cancelled under it (that client's
    channel closed, as a generation's encoder is at a switch): grpc.aio raises
    CancelledError in the handler, which is not the caller's cancellation. The caller
    gets UNAVAILABLE now; it got nothing, and waited for its own deadline (an upsert in
    test_generations_e2e)."""
    echo = _Echo()

    async def body(channel: grpc.aio.Channel) -> None:
        silent = grpc.aio.server()  # accepts the call and never answers it
        port = silent.add_insecure_port("127.0.0.1:0")
        await silent.start()
        echo.inner = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        try:
            call = rerank_pb2_grpc.RerankServiceStub(channel).Rerank(
                rerank_pb2.RerankRequest(query="inner"), timeout=10
            )
            await echo.calling.wait()
            await echo.inner.close()  # cancels the inner call in flight
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
            assert "inner call was cancelled" in (err.value.details() or "")
        finally:
            await silent.stop(0)

    asyncio.run(_with_server(body, echo))


def test_malformed_bytes_and_wrong_wire_types_are_invalid_argument() -> None:
    async def body(channel: grpc.aio.Channel) -> None:
        raw = channel.unary_unary("/retrieval.v1.RerankService/Rerank")
        # field 3 (top_n, a varint) sent as a length-delimited string
        wrong_type = bytes([0x0A, 1, ord("q"), 0x1A, 1, ord("A")])
        for payload, needle in ((wrong_type, "top_n"), (b"\xff\xff\xff", "parsing")):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await raw(payload)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert needle in err.value.details()
        # an unknown field number (a newer client) is accepted
        unknown = bytes([0x0A, 1, ord("q"), 0xF8, 0x06, 0x05])  # field 111, varint 5
        reply = rerank_pb2.RerankResponse.FromString(await raw(unknown))
        assert reply.model == "q"

    asyncio.run(_with_server(body))


def test_a_method_no_service_has_is_unimplemented() -> None:
    """The interceptors let a call with no handler through untouched: gRPC's own answer."""

    async def body(channel: grpc.aio.Channel) -> None:
        for method in ("/retrieval.v1.RerankService/Nope", "/no.such.Service/Call"):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await channel.unary_unary(method)(b"")
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED, method

    asyncio.run(_with_server(body))


def test_health_reflection_and_metrics() -> None:
    async def body(channel: grpc.aio.Channel) -> None:
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(
            health_pb2.HealthCheckRequest(service="retrieval.v1.RerankService")
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        await rerank_pb2_grpc.RerankServiceStub(channel).Rerank(rerank_pb2.RerankRequest(query="a"))

    registry = asyncio.run(_with_server(body))
    text = generate_latest(registry).decode()
    handled = 'code="OK",method="Rerank",service="test",transport="grpc"'
    assert f"grpc_server_handled_total{{{handled}}} 1.0" in text


def test_a_stop_ends_the_health_watcher_whose_cancel_the_check_lost() -> None:
    """The watcher's check answering in the instant the stop cancels it (a Redis ping:
    redis-py sends under 3.11's ``asyncio.wait_for``, which then returns the answer and
    drops the cancel): the stop sends the cancel again. Cancelled once, the watcher went
    on checking, and the stop (a gateway's close) waited for it forever."""

    async def scenario() -> None:
        server, _ = await create_server(ServiceSettings(host="127.0.0.1", port=0), lambda _: [])
        answers: list[asyncio.Future[bool]] = []
        checking = asyncio.Event()

        async def check() -> bool:
            answers.append(asyncio.get_running_loop().create_future())
            checking.set()
            return await asyncio.wait_for(answers[-1], 10.0)  # the stdlib's, as redis-py

        server.watch(check, 0.2, "a Redis-like check")
        await checking.wait()
        answers[-1].set_result(True)  # answered, and in the same instant ...
        stopping = asyncio.ensure_future(server.stop(0))  # ... stopped
        # not cancelled on the way (that would end the wait this test is about): waited for
        done, _ = await asyncio.wait({stopping}, timeout=5.0)
        assert done, "the stop still waits for the health watcher after 5 s"
        health = await server.health.Check(health_pb2.HealthCheckRequest(), None)
        assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING

    asyncio.run(scenario())
