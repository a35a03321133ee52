"""Gateway process: wire encoder, shard router, document store and reranker; serve."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from prometheus_client import CollectorRegistry

from retrieval.v1 import documents_pb2, documents_pb2_grpc, search_pb2, search_pb2_grpc
from services.common.auth import AuthInterceptor
from services.common.balance import Balancing
from services.common.logs import configure_logging
from services.common.metrics import RpcMetrics
from services.common.redis_client import async_client, parse_redis_url
from services.common.server import Admission, Server, create_server, serve_started
from services.common.settings import load_settings
from services.common.slo import slo_for
from services.encoder.base import Encoder
from services.gateway.metrics import GatewayMetrics, QueryCacheMetrics
from services.gateway.pipeline import DocumentPipeline, SearchPipeline
from services.gateway.query_cache import QueryEmbeddingCache
from services.gateway.rerank_client import RerankClient
from services.gateway.servicer import DocumentServicer, SearchServicer, admission_cost
from services.gateway.settings import GatewaySettings, parse_shard_addresses
from services.index.core import coarse
from services.rerank.depths import depth_table

log = logging.getLogger(__name__)


async def build_encoder(settings: GatewaySettings) -> Encoder:
    """The configured encoder: Triton (production) or the model in this process."""
    if settings.encoder == "triton":
        from services.encoder.runtime.triton_client import TritonEncoder, TritonEncoderConfig

        return await TritonEncoder.connect(
            TritonEncoderConfig(
                url=settings.triton_url,
                model=settings.triton_model,
                default_timeout_s=settings.default_timeout_s,
                tls=settings.triton_client_tls(),
                balancing=Balancing(settings.balance, settings.resolve_every_s),
            )
        )
    from services.encoder.runtime.inprocess import InProcessEncoder

    return InProcessEncoder.torch(Path(settings.model_dir) if settings.model_dir else None)


class RedisHealth:
    """The health check of the gateway's Redis: a PING on a connection of its own (not
    one of the request pool), run by the server's health watcher. Without Redis the
    gateway can neither write nor fetch a document, so it answers NOT_SERVING until Redis
    answers again and a load balancer sends clients to a gateway that can serve them."""

    def __init__(self, url: str, timeout_s: float) -> None:
        self._client = async_client(
            url, max_connections=2, pool_timeout_s=timeout_s, socket_timeout=timeout_s
        )

    async def check(self) -> bool:
        return bool(await self._client.ping())

    async def close(self) -> None:
        await self._client.aclose()


@dataclass
class Gateway:
    """A running gateway and what it owns (closed in :meth:`close`)."""

    server: Server
    port: int
    registry: CollectorRegistry
    closers: list[object] = field(default_factory=list)

    async def close(self, grace: float = 1.0) -> None:
        await self.server.stop(grace)
        for part in reversed(self.closers):
            close = getattr(part, "close", None)
            if close is not None:
                result = close()
                if asyncio.iscoroutine(result):
                    await result


async def start_gateway(settings: GatewaySettings) -> Gateway:
    from services.index.client.connection import StoreConnection
    from services.index.client.documents import DocumentReader
    from services.index.client.replicas import HedgePolicy
    from services.index.client.router import ShardRouter
    from services.index.client.tails import LogTailReader
    from services.index.client.writer import ChangeLogWriter
    from services.index.layout import check_layout_at

    registry = CollectorRegistry()
    authenticator = settings.authenticator()
    tls = settings.client_tls()
    encoder = await build_encoder(settings)
    router = ShardRouter(
        parse_shard_addresses(settings.shards),
        hedge=HedgePolicy(enabled=settings.hedge),
        tls=tls,
        balancing=Balancing(settings.balance, settings.resolve_every_s),
    )
    store = StoreConnection(
        settings.redis_url,
        num_shards=router.num_shards,
        max_connections=settings.redis_max_connections,
        pool_timeout_s=settings.redis_pool_timeout_s,
        read_retry_s=settings.redis_read_retry_s,
    )
    writer = ChangeLogWriter(
        store,
        dim=encoder.dim,
        wait_replicas=settings.redis_wait_replicas,
        wait_timeout_ms=settings.redis_wait_timeout_ms,
    )
    stored = DocumentReader(store)
    # Refuse to serve a store of another key layout or shard count (says what to do).
    await asyncio.to_thread(check_layout_at, settings.redis_url, router.num_shards)
    reranker = (
        RerankClient(settings.rerank_url, depth_table(settings.rerank_depth_table), tls)
        if settings.rerank_url
        else None
    )
    metrics = GatewayMetrics.create(
        registry,
        encoder.model_name,
        settings.encoder_size,
        slo_for(settings.encoder_size),
        rerank=bool(settings.rerank_url),
        triton=settings.encoder == "triton",
    )
    query_cache = (
        QueryEmbeddingCache(
            settings.query_cache_redis_url or settings.redis_url,
            model=encoder.model_name,
            size=settings.encoder_size,
            dim=encoder.dim,
            ttl_s=settings.query_cache_ttl_s,
            max_entries=settings.query_cache_max_entries,
            timeout_s=settings.query_cache_timeout_ms / 1000.0,
            lowercase=settings.query_cache_lowercase,
            max_connections=settings.redis_max_connections,
            metrics=QueryCacheMetrics.create(registry),
        )
        if settings.query_cache
        else None
    )
    admission = Admission(
        settings.max_in_flight,
        settings.retry_after_ms,
        high_water=settings.shed_high_water,
        cost=admission_cost,
    )
    search = SearchPipeline(
        encoder,
        router,
        stored,
        LogTailReader(store),
        reranker,
        metrics=metrics,
        default_timeout_s=settings.default_timeout_s,
        pressure=admission.pressure,
        query_cache=query_cache,
        retrieval=settings.retrieval_defaults(),
    )
    documents = DocumentPipeline(
        encoder, writer, stored, default_timeout_s=settings.default_timeout_s
    )

    def register(server: grpc.aio.Server) -> Sequence[str]:
        search_pb2_grpc.add_SearchServiceServicer_to_server(SearchServicer(search), server)
        documents_pb2_grpc.add_DocumentServiceServicer_to_server(
            DocumentServicer(documents), server
        )
        return [
            search_pb2.DESCRIPTOR.services_by_name["SearchService"].full_name,
            documents_pb2.DESCRIPTOR.services_by_name["DocumentService"].full_name,
        ]

    server, port = await create_server(
        settings,
        register,
        RpcMetrics.create(registry, "gateway"),
        admission,
        interceptors=[AuthInterceptor(authenticator)] if authenticator else [],
    )
    redis_health = RedisHealth(settings.redis_url, settings.health_interval_s)
    closers: list[object] = [encoder, router, store, reranker, query_cache, redis_health]
    server.watch(
        redis_health.check,
        settings.health_interval_s,
        f"gateway (Redis {parse_redis_url(settings.redis_url).safe_url})",
    )
    log.info(
        "gateway serving on %s:%d (model %s, %d shards, rerank %s; auth %s; TLS %s; "
        "TLS to shards, rerank and Triton %s)",
        settings.host,
        port,
        encoder.model_name,
        router.num_shards,
        settings.rerank_url or "off",
        "on (bearer tokens)" if authenticator else "OFF (--no-auth: every client may write)",
        _tls_said(settings.server_tls() is not None, settings.tls_client_ca is not None),
        _tls_said(tls is not None, settings.tls_client_cert is not None),
    )
    return Gateway(server, port, registry, closers)


def _tls_said(on: bool, mutual: bool) -> str:
    return ("mTLS" if mutual else "on") if on else "off"


async def serve(settings: GatewaySettings) -> None:
    await serve_started(await start_gateway(settings), settings)


def main(argv: Sequence[str] | None = None) -> int:
    settings = load_settings(GatewaySettings, list(argv or []), prog="gtr-retrieval gateway serve")
    configure_logging(settings.log_format, settings.log_level, service="gateway")
    # The router assigns each wave on this (the event loop's) thread; OpenMP's count is
    # per thread, and its default (every core) leaves idle workers spinning per wave.
    coarse.set_threads(settings.quantizer_threads)
    asyncio.run(serve(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
