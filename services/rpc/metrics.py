"""Prometheus metrics: one registry per process (or per test server), injected.

Metric objects are created by the service that owns them, on its own registry, never
at import time, so several servers can live in one test process.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

from services.common import slo

# Latency buckets (seconds) from 0.5 ms to 10 s: covers a shard search and an xxl encode.
# Every SLO threshold of services/common/slo.py is an edge, so an SLI is a bucket count.
_EDGES = (
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.017,
    0.025,
    0.034,
    0.05,
    0.075,
    0.096,
    0.1,
    0.15,
    0.25,
    0.349,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
LATENCY_BUCKETS: tuple[float, ...] = tuple(sorted(set(_EDGES) | set(slo.thresholds())))
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def latency_histogram(
    name: str, documentation: str, labels: Sequence[str] = (), *, registry: CollectorRegistry
) -> Histogram:
    """A histogram of seconds on :data:`LATENCY_BUCKETS`, the edges of every latency this
    project records: each SLO threshold is one of them, so an SLI is a bucket count."""
    return Histogram(name, documentation, labels, buckets=LATENCY_BUCKETS, registry=registry)


@dataclass
class RpcMetrics:
    """What the server interceptor records for every RPC of one service. ``transport``
    says how the call came: ``grpc``, or ``http`` for the gateway's HTTP/JSON port, whose
    calls are the same RPCs (method and code as gRPC names them) transcoded; a query
    that sums over it (the SLO rules do) counts both."""

    service: str
    latency: Histogram
    handled: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry, service: str) -> RpcMetrics:
        labels = ["service", "method", "code", "transport"]
        return cls(
            service=service,
            latency=latency_histogram(
                "grpc_server_handling_seconds",
                "Wall time of an RPC, by method, status code and transport (grpc, http).",
                labels,
                registry=registry,
            ),
            handled=Counter(
                "grpc_server_handled_total",
                "RPCs completed, by method, status code and transport (grpc, http).",
                labels,
                registry=registry,
            ),
        )

    def observe(
        self,
        method: str,
        code: str,
        seconds: float,
        transport: str = "grpc",
        exemplar: dict[str, str] | None = None,
    ) -> None:
        """``exemplar``: the call's trace id when it was traced (kept with the bucket it
        fell in; exposed in the OpenMetrics format, docs/tracing.md)."""
        self.latency.labels(self.service, method, code, transport).observe(seconds, exemplar)
        self.handled.labels(self.service, method, code, transport).inc()


def serve_metrics(registry: CollectorRegistry, port: int, host: str = "127.0.0.1") -> int:
    """Expose ``registry`` on http://host:port/metrics (port 0 = free port); return the port.
    A scraper that asks for ``application/openmetrics-text`` (Prometheus does) gets the
    OpenMetrics format, with the histograms' exemplars (trace ids, docs/tracing.md)."""
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return int(server.server_port)
