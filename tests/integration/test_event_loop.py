"""Every server runs on uvloop unless told otherwise (services/rpc/event_loop.py), and our
gRPC server, its health service and a Redis client work on it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import numpy as np
import pytest
import redis.asyncio as aioredis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.rpc import event_loop
from services.rpc.server import create_server
from services.rpc.settings import ServiceSettings, load_settings
from tests.support.processes import RedisServer
from tests.support.shards import start_shard, train_test_index


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_run_gives_uvloop_by_default_and_asyncio_on_request() -> None:
    assert event_loop.run(_loop_module()).startswith("uvloop")
    assert event_loop.run(_loop_module(), "asyncio").startswith("asyncio")


def test_the_setting_defaults_to_uvloop_and_refuses_another_name() -> None:
    assert ServiceSettings().event_loop == "uvloop"
    assert load_settings(ServiceSettings, ["--event-loop", "asyncio"]).event_loop == "asyncio"
    with pytest.raises(SystemExit):
        load_settings(ServiceSettings, ["--event-loop", "trio"])


def test_a_server_of_ours_answers_on_uvloop(redis_server: RedisServer) -> None:
    """Health over gRPC and a Redis round trip, both on one uvloop loop."""

    async def scenario() -> tuple[str, int, object]:
        server, port = await create_server(ServiceSettings(port=0), lambda _: [])
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=5
                )
            client = aioredis.Redis.from_url(redis_server.url)
            try:
                await client.set("event-loop", b"uvloop")
                stored = await client.get("event-loop")
            finally:
                await client.aclose()
        finally:
            await server.stop(0)
        return await _loop_module(), reply.status, stored

    module, status, stored = event_loop.run(scenario())
    assert module.startswith("uvloop")
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert stored == b"uvloop"


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_shard_process_serves_on_the_loop_it_is_given(
    loop: str, tmp_path: Path, redis_server: RedisServer
) -> None:
    """``index serve`` as a process: once it answers its health check, uvloop's extension
    is mapped into it by default, and not with ``--event-loop asyncio``."""
    vectors = np.random.default_rng(0).standard_normal((300, 16)).astype(np.float32)
    index_dir = train_test_index(vectors, tmp_path / "index", nlist=4)
    settings = {} if loop == "uvloop" else {"event-loop": "asyncio"}
    shard = start_shard(
        index_dir=index_dir,
        redis_url=redis_server.url,
        shard=0,
        shards=1,
        work_dir=tmp_path,
        settings=settings,
        timeout=120,
    )
    try:
        assert shard.process is not None
        mapped = "uvloop" in Path(f"/proc/{shard.process.pid}/maps").read_text()
        assert mapped is (loop == "uvloop"), shard.log_tail()
    finally:
        shard.stop()
