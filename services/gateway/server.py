"""Gateway process: wire encoder, shard router, document store and reranker; serve.

The encoder, the shard router and the store clients are per index generation
(docs/generations.md): :class:`GenerationParts` builds them for the generation the alias
names, and :class:`~services.gateway.generations.GenerationSource` gives each request
the serving one's.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from prometheus_client import CollectorRegistry

from retrieval.v1 import documents_pb2, documents_pb2_grpc, search_pb2, search_pb2_grpc
from services.common.errors import FailedPrecondition, Unavailable
from services.common.slo import slo_for
from services.encoder.base import Encoder
from services.gateway.document_pipeline import DocumentPipeline
from services.gateway.encoders import build_encoder, encoder_spec
from services.gateway.generation_parts import Bundle, RedisAliasReader, Serving
from services.gateway.generations import GenerationSource
from services.gateway.http_port import start_http_port
from services.gateway.latency_report import LatencyReporter, reporter_id
from services.gateway.metrics import (
    GatewayMetrics,
    GenerationMetrics,
    QueryCacheMetrics,
    ServingEvents,
)
from services.gateway.pipeline import SearchPipeline
from services.gateway.query_cache import QueryEmbeddingCache
from services.gateway.rerank_client import RerankClient
from services.gateway.servicer import DocumentServicer, SearchServicer, admission_cost
from services.gateway.settings import GatewaySettings
from services.generations.registry import EncoderSpec, Generation
from services.index.client.addresses import parse_shard_addresses
from services.index.core import coarse
from services.process.hold import Holder
from services.process.logs import configure_logging
from services.process.redis_client import async_client, parse_redis_url
from services.rerank.depths import depth_table
from services.rpc import event_loop
from services.rpc.admission import Admission
from services.rpc.auth import AuthInterceptor
from services.rpc.balance import Balancing
from services.rpc.metrics import RpcMetrics
from services.rpc.server import Server, create_server, serve_started
from services.rpc.settings import load_settings
from services.rpc.tls import ClientTLS
from services.telemetry import tracing

if TYPE_CHECKING:
    from services.index.client.connection import StoreConnection

log = logging.getLogger(__name__)


class GenerationParts:
    """Builds a generation's :class:`~services.gateway.generation_parts.Bundle` from the real
    clients (the :class:`~services.gateway.generations.GenerationSource`'s factory).

    * **Encoder**: the gateway's own (``--triton-model`` at the version pinned at start,
      or ``--model-dir``) for a generation recorded with it; otherwise Triton's model at
      the generation's version (one the rollout published, ``encoder publish``), or
      in-process the checkpoint folder it records. A record with no version (version 0:
      written before any publish, e.g. by a shard from its manifest) means the
      repository's first version, 1, never "the newest": the own encoder pins the newest
      at start, which after a publish is the new encoder, not the store's. A generation
      whose width differs from that encoder's is refused.
    * **Shards**: g1's are ``--shards``; another generation's are its addresses in
      ``{gtr}:addrs`` (the local stack and the chart write them when its shards start).
    * **Store clients**: on the shared connection, with the generation's keys (its logs,
      its layout's documents and writer gates).
    """

    def __init__(self, settings: GatewaySettings, store: Any, base_shards: int, own: Encoder):
        self.settings = settings
        self.store = store
        self.base_shards = base_shards
        self.own = own
        self.own_spec = encoder_spec(settings, own)

    def _is_own(self, spec: EncoderSpec) -> bool:
        if self.settings.encoder == "triton":  # version 0: the first version (see above)
            return (spec.version or 1) == self.own_spec.version and (
                spec.version == 0 or spec.model in ("", self.settings.triton_model)
            )
        return (
            not spec.source
            or not Path(spec.source).is_dir()
            or (Path(spec.source).resolve() == Path(self.own_spec.source).resolve())
        )

    async def encoder(self, gen: Generation, queries: bool = True) -> tuple[Encoder, bool]:
        """(the generation's encoder, whether the bundle owns it); ``queries=False``: one
        that only embeds documents (the dual write's)."""
        spec = gen.encoder
        if self._is_own(spec):
            encoder, owned = self.own, False
        elif self.settings.encoder == "triton":
            model = spec.model if spec.version else ""  # version 0: --triton-model's 1
            version = spec.version or 1
            built = await build_encoder(self.settings, model, version, queries=queries)
            encoder, owned = built, True
        else:
            encoder, owned = await build_encoder(self.settings, model_dir=spec.source), True
        if spec.dim and encoder.dim != spec.dim:
            if owned:
                await encoder.close()
            raise FailedPrecondition(
                f"generation {gen.name} holds {spec.dim}-d vectors, its encoder "
                f"({encoder.model_name}) gives {encoder.dim}-d ones"
            )
        return encoder, owned

    async def document_encoder(self, gen: Generation) -> tuple[Encoder, bool]:
        """The encoder a dual write embeds ``gen``'s documents with."""
        return await self.encoder(gen, queries=False)

    async def __call__(self, gen: Generation) -> Bundle:
        from services.generations.registry import read_addresses
        from services.index.client.documents import DocumentReader
        from services.index.client.replicas import HedgePolicy
        from services.index.client.router import ShardRouter
        from services.index.client.tails import LogTailReader
        from services.index.client.writer import ChangeLogWriter
        from services.index.keys import ADDRESSES_KEY, FIRST_GENERATION

        settings = self.settings
        if gen.name == FIRST_GENERATION and settings.shards:
            addresses: str | None = settings.shards
        else:  # g1 without --shards too: the addresses its shards registered
            addresses = await read_addresses(self.store.redis, gen.name)
        if not addresses:
            raise Unavailable(
                f"generation {gen.name} has no shard addresses in {ADDRESSES_KEY} yet (its "
                "shards start once it is trained"
                + ("; or give g1's as --shards)" if gen.name == FIRST_GENERATION else ")")
            )
        router = ShardRouter(
            parse_shard_addresses(addresses),
            hedge=HedgePolicy(enabled=settings.hedge),
            tls=settings.client_tls(),
            balancing=Balancing(settings.balance, settings.resolve_every_s),
        )
        if router.num_shards != gen.num_shards:
            await router.close()
            raise FailedPrecondition(
                f"generation {gen.name} has {gen.num_shards} shards, its addresses "
                f"({addresses}) name {router.num_shards}"
            )
        try:
            encoder, owned = await self.encoder(gen)
        except BaseException:
            await router.close()
            raise
        keys = gen.keys(self.base_shards)
        writer = ChangeLogWriter(
            self.store,
            dim=encoder.dim,
            keys=keys,
            wait_replicas=settings.redis_wait_replicas,
            wait_timeout_ms=settings.redis_wait_timeout_ms,
        )
        return Bundle(
            gen.name,
            encoder,
            router,
            DocumentReader(self.store, keys.layout),
            LogTailReader(self.store, keys),
            writer,
            owned=[encoder, router] if owned else [router],
        )


def base_shard_count(settings: GatewaySettings, wait_s: float = 60.0) -> int:
    """The store's base shard count (generation g1's): ``--shards``'s, or without them the
    store's key layout's (so a gateway needs no addresses of a retired g1). A store with no
    layout yet needs ``--shards``: FailedPrecondition. While Redis cannot be reached, tried
    again for up to ``wait_s`` (as the layout check does), then Unavailable."""
    from services.generations.registry import Registry
    from services.process.redis_client import with_sync_client

    if settings.shards:
        return len(parse_shard_addresses(settings.shards))
    try:
        return with_sync_client(
            settings.redis_url,
            lambda client: Registry(client).base_shards(),
            to="read the base shard count",
            wait_s=wait_s,
        )
    except FailedPrecondition:
        raise FailedPrecondition(
            "--shards is empty and the store has no key layout yet: give generation "
            "g1's shard addresses as --shards (they set the store's base shard count)"
        ) from None


def record_first_generation(url: str, num_shards: int, spec: EncoderSpec) -> None:
    """Generation g1 (the gateway's shards and encoder), serving, unless the store has
    its generations recorded already (whoever starts first records it)."""
    from services.generations.registry import Registry
    from services.process.redis_client import sync_client

    client = sync_client(url)
    try:
        Registry(client).ensure_first(num_shards, spec, "")
    finally:
        client.close()


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
    http_port: int | None = None  # the HTTP/JSON port (--http-port), None without one

    async def close(self, grace: float = 1.0) -> None:
        await self.server.stop(grace)
        for part in reversed(self.closers):
            close = getattr(part, "close", None)
            if close is not None:
                result = close()
                if asyncio.iscoroutine(result):
                    await result


async def start_gateway(settings: GatewaySettings) -> Gateway:
    registry = CollectorRegistry()
    authenticator = settings.authenticator()
    tls = settings.client_tls()
    encoder = await build_encoder(settings)
    store, num_shards = await _open_store(settings, encoder)
    generation_metrics = GenerationMetrics.create(registry)
    metrics = _gateway_metrics(settings, registry, encoder)
    parts = GenerationParts(settings, store, num_shards, encoder)
    source = GenerationSource(
        RedisAliasReader(store.redis),
        parts,
        refresh_s=settings.alias_refresh_ms / 1000.0,
        events=ServingEvents(generation_metrics, metrics),
        encoders=parts.document_encoder,
    )
    try:
        serving = await source.start()
    except BaseException:
        for part in (source, store, encoder):
            await part.close()
        raise
    reranker = (
        RerankClient(settings.rerank_url, depth_table(settings.rerank_depth_table), tls)
        if settings.rerank_url
        else None
    )
    query_cache = _query_cache(settings, encoder, registry)
    admission = Admission(
        settings.max_in_flight,
        settings.retry_after_ms,
        high_water=settings.shed_high_water,
        cost=admission_cost,
        client_share=settings.client_share,
    )
    search = SearchPipeline(
        source,
        reranker,
        metrics=metrics,
        default_timeout_s=settings.default_timeout_s,
        pressure=admission.pressure,
        query_cache=query_cache,
        retrieval=settings.retrieval_defaults(),
        hold=_holder(settings, generation_metrics),
    )
    documents = DocumentPipeline(
        source,
        default_timeout_s=settings.default_timeout_s,
        on_moved=generation_metrics.moved_writes.inc,
        on_dual=lambda outcome: generation_metrics.dual_encodes.labels(outcome).inc(),
    )
    servicers = {
        SEARCH_SERVICE: SearchServicer(search),
        DOCUMENT_SERVICE: DocumentServicer(documents),
    }
    rpc_metrics = RpcMetrics.create(registry, "gateway")
    server, port = await create_server(
        settings,
        _registrar(servicers),
        rpc_metrics,
        admission,
        interceptors=[AuthInterceptor(authenticator)] if authenticator else [],
        public=True,  # clients are told which shard failed, not where it runs
    )
    try:
        http = await start_http_port(settings, server, servicers, authenticator, rpc_metrics)
    except BaseException:
        await server.stop(0)
        raise
    redis_health = RedisHealth(settings.redis_url, settings.health_interval_s)
    closers: list[object] = [
        LatencyReporter.started(store.redis, search.latency, reporter_id(port)),
        *(encoder, store, source, reranker, query_cache, redis_health, search.hold),
    ]
    redis_name = f"gateway (Redis {parse_redis_url(settings.redis_url).safe_url})"
    server.watch(redis_health.check, settings.health_interval_s, redis_name)
    _log_serving(settings, port, serving, tls, authenticated=authenticator is not None)
    if http is not None:
        log.info("gateway HTTP/JSON on %s:%d (docs/http.md)", settings.host, http.port)
    return Gateway(server, port, registry, closers, http.port if http is not None else None)


async def _open_store(settings: GatewaySettings, encoder: Encoder) -> tuple[StoreConnection, int]:
    """The store's connection and generation g1's shard count; refuses a store of another
    key layout or shard count (saying what to do) and records g1 on first use."""
    from services.index.client.connection import StoreConnection
    from services.index.layout import check_layout_at

    num_shards = await asyncio.to_thread(base_shard_count, settings)  # generation g1's
    store = StoreConnection(
        settings.redis_url,
        num_shards=num_shards,
        max_connections=settings.redis_max_connections,
        pool_timeout_s=settings.redis_pool_timeout_s,
        read_retry_s=settings.redis_read_retry_s,
    )
    # Refuse to serve a store of another key layout or shard count (says what to do).
    await asyncio.to_thread(check_layout_at, settings.redis_url, num_shards)
    await asyncio.to_thread(
        record_first_generation, settings.redis_url, num_shards, encoder_spec(settings, encoder)
    )
    return store, num_shards


def _holder(settings: GatewaySettings, metrics: GenerationMetrics) -> Holder | None:
    """The pause of a rollout's processes while searches run (``--hold-file``); None
    without one."""
    if not settings.hold_file:
        return None
    return Holder.opened(
        Path(settings.hold_file),
        max_hold_s=settings.hold_max_ms / 1000.0,
        on_release=metrics.rollout_held_for,
    )


def _gateway_metrics(
    settings: GatewaySettings, registry: CollectorRegistry, encoder: Encoder
) -> GatewayMetrics:
    return GatewayMetrics.create(
        registry,
        encoder.model_name,
        settings.encoder_size,
        slo_for(settings.encoder_size),
        rerank=bool(settings.rerank_url),
        triton=settings.encoder == "triton",
    )


def _query_cache(
    settings: GatewaySettings, encoder: Encoder, registry: CollectorRegistry
) -> QueryEmbeddingCache | None:
    """The query-embedding cache of ``--query-cache``; None when it is off."""
    if not settings.query_cache:
        return None
    return QueryEmbeddingCache(
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


SEARCH_SERVICE = search_pb2.DESCRIPTOR.services_by_name["SearchService"].full_name
DOCUMENT_SERVICE = documents_pb2.DESCRIPTOR.services_by_name["DocumentService"].full_name


def _registrar(servicers: dict[str, Any]) -> Callable[[grpc.aio.Server], Sequence[str]]:
    """What adds the public services' servicers (``servicers``, by service name, the
    objects the HTTP/JSON port calls too) to the server; their names for reflection and
    health."""

    def register(server: grpc.aio.Server) -> Sequence[str]:
        search_pb2_grpc.add_SearchServiceServicer_to_server(servicers[SEARCH_SERVICE], server)
        documents_pb2_grpc.add_DocumentServiceServicer_to_server(
            servicers[DOCUMENT_SERVICE], server
        )
        return [SEARCH_SERVICE, DOCUMENT_SERVICE]

    return register


def _log_serving(
    settings: GatewaySettings,
    port: int,
    serving: Serving,
    tls: ClientTLS | None,
    *,
    authenticated: bool,
) -> None:
    log.info(
        "gateway serving on %s:%d (generation %s: model %s, %d shards; rerank %s; auth %s; "
        "TLS %s; TLS to shards, rerank and Triton %s)",
        settings.host,
        port,
        serving.generation,
        serving.bundle.encoder.model_name,
        serving.bundle.index.num_shards,
        settings.rerank_url or "off",
        "on (bearer tokens)" if authenticated else "OFF (--no-auth: every client may write)",
        _tls_said(settings.server_tls() is not None, settings.tls_client_ca is not None),
        _tls_said(tls is not None, settings.tls_client_cert is not None),
    )


def _tls_said(on: bool, mutual: bool) -> str:
    return ("mTLS" if mutual else "on") if on else "off"


async def serve(settings: GatewaySettings) -> None:
    with tracing.traced(settings.tracing(), "gtr-gateway"):
        gateway = await start_gateway(settings)
        # What start-up built (models, clients, modules) lives as long as the process: out
        # of the collector's sight, so a full collection under load walks only what
        # requests made. Under a k=1000 burst the collector took ~10 % of the event loop,
        # up to 0.2 s at a time, while gRPC accepted no call (py-spy on
        # bench/overload.py, issue #22).
        gc.freeze()
        await serve_started(gateway, settings)


def main(argv: Sequence[str] | None = None) -> int:
    settings = load_settings(GatewaySettings, list(argv or []), prog="gtr-retrieval gateway serve")
    configure_logging(settings.log_format, settings.log_level, service="gateway")
    # The router assigns each wave on this (the event loop's) thread; OpenMP's count is
    # per thread, and its default (every core) leaves idle workers spinning per wave.
    coarse.set_threads(settings.quantizer_threads)
    event_loop.run(serve(settings), settings.event_loop, settings.loop_watch_ms)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
