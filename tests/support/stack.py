"""The serving stack in a test: real shard and gateway gRPC servers on free ports.

Shards and the gateway run in the test's event loop (real grpc.aio servers on real
sockets); Redis and Triton are real processes started by fixtures.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from services.gateway.server import Gateway, start_gateway
from services.gateway.settings import GatewaySettings
from services.index.server.process import RunningShard, start_shard
from services.index.server.settings import ShardSettings


@dataclass
class TestStack:
    gateway: Gateway
    shards: list[list[RunningShard]] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gateway.port}"


def shard_settings(
    shard: int, shards: int, replica: int, redis_url: str, index_dir: Path, tmp: Path
) -> ShardSettings:
    return ShardSettings(
        port=0,
        shard=shard,
        shards=shards,
        replica=f"r{replica}",
        redis_url=redis_url,
        index_dir=str(index_dir),
        snapshot_dir=str(tmp / f"snap-{shard}-{replica}"),
        snapshot_every_entries=1_000_000,
        snapshot_every_s=3600.0,
    )


@asynccontextmanager
async def running_stack(
    redis_url: str,
    index_dir: Path,
    tmp: Path,
    *,
    shards: int = 2,
    replicas: int = 1,
    triton_url: str | None = None,
    gateway_settings: dict[str, object] | None = None,
) -> AsyncIterator[TestStack]:
    """``gateway_settings``: more GatewaySettings fields (e.g. ``{"query_cache": True}``)."""
    running: list[list[RunningShard]] = []
    gateway = None
    try:
        for s in range(shards):
            running.append([])
            for r in range(replicas):
                settings = shard_settings(s, shards, r, redis_url, index_dir, tmp)
                running[s].append(await start_shard(settings))
        spec = ";".join(",".join(f"127.0.0.1:{x.port}" for x in reps) for reps in running)
        gateway = await start_gateway(
            GatewaySettings(
                port=0,
                redis_url=redis_url,
                shards=spec,
                encoder="triton" if triton_url else "inprocess",
                triton_url=triton_url or "127.0.0.1:1",
                # open unless a test configures tokens ({"auth": True, ...})
                **({"auth": False} | (gateway_settings or {})),  # type: ignore[arg-type]
            )
        )
        yield TestStack(gateway, running)
    finally:
        if gateway is not None:
            await gateway.close(0)
        for reps in running:
            for shard in reps:
                await shard.close(0, snapshot=False)
