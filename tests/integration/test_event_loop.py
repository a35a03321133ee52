"""Every server runs on uvloop unless told otherwise (services/rpc/event_loop.py), and our
gRPC server, its health service and a Redis client work on it."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
import redis.asyncio as aioredis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.rpc import event_loop
from services.rpc.server import create_server
from services.rpc.settings import ServiceSettings, load_settings
from tests.support.local_stack import cli_env
from tests.support.processes import RedisServer, free_port, stop_process, wait_until
from tests.support.shards import train_test_index


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


@pytest.mark.parametrize("flags", [[], ["--event-loop", "asyncio"]], ids=["default", "asyncio"])
def test_a_shard_process_serves_on_the_loop_it_is_given(
    flags: list[str], tmp_path: Path, redis_server: RedisServer
) -> None:
    """``index serve`` as a process: once it answers its health check, uvloop's extension
    is mapped into it by default, and not with ``--event-loop asyncio``."""
    vectors = np.random.default_rng(0).standard_normal((300, 16)).astype(np.float32)
    index_dir = train_test_index(vectors, tmp_path / "index", nlist=4)
    port = free_port()
    argv = [sys.executable, "-m", "services.cli.main", "index", "serve", "--port", str(port)]
    argv += ["--redis-url", redis_server.url, "--index-dir", str(index_dir)]
    argv += ["--snapshot-dir", str(tmp_path / "snap"), "--shard", "0", "--shards", "1"]
    proc = subprocess.Popen(
        [*argv, *flags], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=cli_env()
    )
    try:
        wait_until(lambda: _serving(port) or proc.poll() is not None, "the shard serving", 120)
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        mapped = "uvloop" in Path(f"/proc/{proc.pid}/maps").read_text()
        assert mapped is (not flags)
    finally:
        stop_process(proc)


def _serving(port: int) -> bool:
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=1
            )
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
    except grpc.RpcError:
        return False
