"""Shard replica process: load, replay the log, serve IndexShardService."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import faiss
import grpc
from prometheus_client import CollectorRegistry
from threadpoolctl import threadpool_limits

from retrieval.v1 import index_pb2, index_pb2_grpc
from services.index.core.gpu import GpuMetrics, attach_or_fallback
from services.index.core.trained import MANIFEST
from services.index.server.batcher import SearchBatcher
from services.index.server.metrics import ShardMetrics
from services.index.server.replica import ShardReplica
from services.index.server.seeding import seed_from_peers
from services.index.server.service import ShardService
from services.index.server.servicer import ShardServicer
from services.index.server.settings import ShardSettings
from services.process.logs import configure_logging
from services.rpc import event_loop
from services.rpc.admission import Admission
from services.rpc.metrics import RpcMetrics
from services.rpc.server import Server, create_server, serve_started
from services.rpc.settings import load_settings
from services.telemetry import tracing

log = logging.getLogger(__name__)


@dataclass
class RunningShard:
    server: Server
    port: int
    replica: ShardReplica
    batcher: SearchBatcher
    registry: CollectorRegistry

    async def close(self, grace: float = 1.0, snapshot: bool = True) -> None:
        await self.server.stop(grace)
        self.batcher.close()
        await asyncio.get_running_loop().run_in_executor(None, self.replica.stop, snapshot)
        await self.replica.close()


async def start_shard(settings: ShardSettings) -> RunningShard:
    """Load the shard (seeded from a peer first when it cannot replay its log, see
    :mod:`services.index.server.seeding`), replay its log (health stays NOT_SERVING until
    then), serve; from then on health follows the log consumer thread (NOT_SERVING once it
    has died, see :attr:`ShardReplica.consuming`)."""
    faiss.omp_set_num_threads(settings.omp_threads)
    registry = CollectorRegistry()
    metrics = ShardMetrics.create(registry, settings.shard, settings.replica, settings.generation)
    loop = asyncio.get_running_loop()
    if settings.peers and not (Path(settings.index_dir) / MANIFEST).exists():
        await seed_from_peers(settings, with_index=True)  # the trained index as well
    replica = await loop.run_in_executor(None, ShardReplica, settings, metrics)
    trimmed: bool = bool(settings.peers) and await loop.run_in_executor(None, replica.trimmed)
    if trimmed:  # nothing on disk can be replayed from: a peer's snapshot
        try:
            await seed_from_peers(settings)
        except BaseException:
            await replica.close()
            raise
        await loop.run_in_executor(None, replica.reload)
    gpu_metrics = GpuMetrics.create(registry, settings.shard, settings.replica)
    await loop.run_in_executor(
        None, attach_or_fallback, replica.shard, settings.gpu, settings.gpu_device, gpu_metrics
    )
    replica.start(loop)
    batcher = SearchBatcher(
        replica.shard,
        workers=settings.search_threads,
        metrics=metrics,
        omp_threads=settings.omp_threads,
    )
    service = ShardService(replica, batcher, default_timeout_s=settings.default_timeout_s)

    admission = Admission(settings.max_in_flight, settings.retry_after_ms)

    servicer = ShardServicer(service, admission)

    def register(server: grpc.aio.Server) -> Sequence[str]:
        index_pb2_grpc.add_IndexShardServiceServicer_to_server(servicer, server)
        return [index_pb2.DESCRIPTOR.services_by_name["IndexShardService"].full_name]

    server, port = await create_server(
        settings, register, RpcMetrics.create(registry, "index"), admission=admission
    )
    server.drains.append(servicer.drain)
    await server.set_serving(False)
    ready = await loop.run_in_executor(None, replica.ready.wait, settings.ready_timeout_s)
    if not ready:
        raise TimeoutError(f"shard {settings.shard} did not replay its log in time")
    await server.set_serving(True)

    async def consuming() -> bool:
        return replica.consuming

    server.watch(consuming, settings.health_interval_s, f"shard {settings.shard} log consumer")
    log.info(
        "shard %d/%d of generation %s, replica %s serving on port %d at log position %s "
        "(%d vectors)",
        settings.shard,
        settings.shards,
        settings.generation,
        settings.replica,
        port,
        replica.shard.applied,
        len(replica.shard),
    )
    return RunningShard(server, port, replica, batcher, registry)


async def serve(settings: ShardSettings) -> None:
    resource = {
        "gtr.shard": str(settings.shard),
        "gtr.generation": settings.generation,
        "service.instance.id": settings.replica,
    }
    with tracing.traced(settings.tracing(), "gtr-index-shard", resource):
        await serve_started(await start_shard(settings), settings)


def main(argv: Sequence[str] | None = None) -> int:
    settings = load_settings(ShardSettings, list(argv or []), prog="gtr-retrieval index serve")
    configure_logging(settings.log_format, settings.log_level, service=f"shard-{settings.shard}")
    # numpy's BLAS (the refine's batched matmul) gets the thread count of a FAISS call;
    # left at one thread per core, its worker spins between calls: measured, a whole core
    # kept busy beside a shard's search loop.
    threadpool_limits(settings.omp_threads, user_api="blas")
    event_loop.run(serve(settings), settings.event_loop, settings.loop_watch_ms)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
