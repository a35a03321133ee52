"""The gateway's HTTP/JSON port (``--http-port``, docs/http.md): its routes (the public
services' ``google.api.http`` rules and the health check) answered by the very servicers
the gRPC port registered, under the gRPC port's admission limit, tokens, TLS files and
RPC metrics (:mod:`services.rpc.http`)."""

from __future__ import annotations

from collections.abc import Mapping

from services.gateway.settings import GatewaySettings
from services.rpc.auth import Authenticator
from services.rpc.http.rules import public_routes
from services.rpc.http.server import HttpServer, Transcoder, start_http_server
from services.rpc.metrics import RpcMetrics
from services.rpc.server import Server

HEALTH_SERVICE = "grpc.health.v1.Health"


async def start_http_port(
    settings: GatewaySettings,
    server: Server,
    servicers: Mapping[str, object],
    authenticator: Authenticator | None,
    metrics: RpcMetrics,
) -> HttpServer | None:
    """The HTTP/JSON server beside ``server`` (None without ``--http-port``); it stops
    with ``server`` (the same grace)."""
    if settings.http_port is None:
        return None
    transcoder = Transcoder.build(
        public_routes(),
        {**servicers, HEALTH_SERVICE: server.health},
        admission=server.admission,
        authenticator=authenticator,
        metrics=metrics,
        public=True,  # as the gRPC port: internal addresses stay out of error texts
    )
    tls = settings.server_tls()
    http = await start_http_server(
        transcoder,
        settings.host,
        settings.http_port,
        max_body_bytes=settings.max_message_mb * 1024 * 1024,
        ssl_context=tls.ssl_context() if tls is not None else None,
    )
    server.also_stop.append(http.stop)
    return http
