"""Settings shared by every service, and the one way to load them.

Each service defines one pydantic-settings class (``services/<svc>/settings.py``)
that derives from :class:`ServiceSettings`. Values come from, in order of precedence:
command-line flags, environment variables (``GTR_<SERVICE>_<FIELD>``), defaults.
Nothing is read at import time; :func:`load_settings` validates everything at start
and turns a validation error into one clear message.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, TypeVar

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.telemetry.config import ENDPOINT_HELP, RATIO_HELP, TracingConfig

if TYPE_CHECKING:
    from services.rpc.tls import ClientTLS, ServerTLS


class ServiceSettings(BaseSettings):
    """What every gRPC process needs: where to listen, how to log, how to stop."""

    model_config = SettingsConfigDict(
        extra="forbid", validate_default=True, cli_kebab_case=True, cli_implicit_flags=True
    )

    host: str = Field("127.0.0.1", description="Interface to listen on (0.0.0.0 in a pod).")
    port: int = Field(0, ge=0, le=65535, description="gRPC port; 0 picks a free one.")
    metrics_port: int | None = Field(
        None, ge=0, le=65535, description="Prometheus /metrics port; unset = no endpoint."
    )
    log_format: Literal["text", "json"] = Field("text", description="Log line format.")
    event_loop: Literal["uvloop", "asyncio"] = Field(
        "uvloop",
        description="The process's event loop: uvloop (a gRPC round trip costs about two "
        "thirds of the CPU, docs/performance.md) or the standard library's asyncio.",
    )
    loop_watch_ms: float = Field(
        0,
        ge=0,
        description="Log a WARNING, with the event loop thread's Python stack and the CPU "
        "it used over the last half of it, whenever the process's event loop is this many "
        "ms late (code holding it, or its thread waiting for a CPU): what delays every "
        "request in flight and no request's timings show (services/process/loop_watch.py). "
        "0 = off (the watch adds two wake-ups every half of it).",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    grace_seconds: float = Field(
        5.0, ge=0, description="On SIGTERM, in-flight RPCs get this long to finish."
    )
    max_message_mb: int = Field(64, ge=1, le=1024, description="Max gRPC message size.")
    max_in_flight: int = Field(
        0,
        ge=0,
        description="Unary requests in flight at most; one more is refused at once with "
        "RESOURCE_EXHAUSTED and a retry-after-ms hint (health and reflection always "
        "answer). The gateway counts a search as one per 25 hits it may return or "
        "rerank (k=100: 4; k=1000: 40, at most the limit). 0 = no limit.",
    )
    retry_after_ms: int = Field(
        100, ge=1, description="The retry-after-ms hint of a request refused over the limit."
    )
    client_share: float = Field(
        1.0,
        gt=0,
        le=1,
        description="Share of --max-in-flight one client may hold once the server is past "
        "its high-water mark (three quarters of the limit): its next call is refused "
        "RESOURCE_EXHAUSTED with the hint, so one client's burst leaves room for the others. "
        "A client is its bearer token, else its connection; its first call is never refused "
        "by its share. 1 = no share (the default of internal services, whose one client is "
        "the gateway).",
    )
    max_streams_per_connection: int | None = Field(
        None,
        ge=1,
        description="HTTP/2 streams (calls) one client connection may have open at once; "
        "beyond it gRPC refuses new streams (UNAVAILABLE, 'stream refused') until some end, "
        "and a client's own gRPC queues calls past the limit it was told. Without it one "
        "connection sending calls with a 5 ms deadline filled gRPC's server-wide backlog of "
        "calls not yet handed to Python with expired calls, and gRPC refused other "
        "clients' calls CANCELLED (docs/architecture.md, 'One client's flood'). Unset: "
        "max(512, 4 x --max-in-flight).",
    )
    health_interval_s: float = Field(
        1.0,
        gt=0,
        description="How often a background watcher checks what this process depends on "
        "(gateway: its Redis; index shard: its log consumer thread; rerank: nothing) and "
        "sets the gRPC health status to match.",
    )
    port_file: str | None = Field(
        None, description="Write the bound gRPC port to this file once serving (for launchers)."
    )
    tls_cert: str | None = Field(
        None,
        description="PEM certificate (chain) of this server; with --tls-key: TLS only. "
        "Re-read when it changes on disk: new connections get the new one, open ones go on.",
    )
    tls_key: str | None = Field(None, description="PEM private key of --tls-cert.")
    health_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Also serve the gRPC health service alone, plaintext, on this port (for "
        "probes that cannot speak TLS, as Kubernetes' gRPC probes); unset = none.",
    )
    tls_client_ca: str | None = Field(
        None,
        description="PEM CA that must have signed a client's certificate: given, every "
        "client must present one (mTLS); needs --tls-cert.",
    )

    otlp_endpoint: str | None = Field(None, description=ENDPOINT_HELP)
    trace_sample_ratio: float | None = Field(None, ge=0, le=1, description=RATIO_HELP)

    @model_validator(mode="after")
    def _tracing(self) -> ServiceSettings:
        self.tracing()  # a bad OTEL_TRACES_SAMPLER_ARG stops the process at start
        return self

    def tracing(self) -> TracingConfig:
        """Where this process sends its trace spans, and how many (the flags, else the
        OpenTelemetry environment variables; services/telemetry/config.py)."""
        return TracingConfig.resolve(self.otlp_endpoint, self.trace_sample_ratio, os.environ)

    @model_validator(mode="after")
    def _tls_files(self) -> ServiceSettings:
        from services.rpc.tls import ServerTLS

        tls = ServerTLS.from_paths(self.tls_cert, self.tls_key, self.tls_client_ca)
        if tls is not None:
            tls.check()
        return self

    def streams_per_connection(self) -> int:
        """``max_streams_per_connection``, or its default from ``max_in_flight``."""
        if self.max_streams_per_connection is not None:
            return self.max_streams_per_connection
        return max(512, 4 * self.max_in_flight)

    def server_tls(self) -> ServerTLS | None:
        """This server's TLS configuration (None: plaintext)."""
        from services.rpc.tls import ServerTLS

        return ServerTLS.from_paths(self.tls_cert, self.tls_key, self.tls_client_ca)


class ClientTLSSettings(ServiceSettings):
    """A service that also dials other gRPC services (the gateway: the shards, the
    reranker and Triton; a shard: the peer it seeds a snapshot from): the TLS of those
    connections, ``--tls-ca`` / ``--tls-client-cert`` / ``--tls-client-key``."""

    tls_ca: str | None = Field(
        None,
        description="PEM CA this process trusts for its own connections (the gateway: to "
        "the shards, the reranker and Triton; a shard: to the peer it seeds a snapshot "
        "from); given, they speak TLS. When it or the client certificate changes on disk "
        "the channels are rebuilt (new calls use the new files).",
    )
    tls_client_cert: str | None = Field(
        None,
        description="PEM certificate this process presents on those connections (mTLS); "
        "with --tls-client-key.",
    )
    tls_client_key: str | None = Field(None, description="PEM private key of --tls-client-cert.")

    @model_validator(mode="after")
    def _client_tls_files(self) -> ClientTLSSettings:
        tls = self.client_tls()
        if tls is not None:
            tls.check()
        return self

    def client_tls(self) -> ClientTLS | None:
        """TLS of this process's own connections (None: plaintext)."""
        from services.rpc.tls import ClientTLS

        return ClientTLS.from_paths(self.tls_ca, self.tls_client_cert, self.tls_client_key)


REDIS_URL_FILE_HELP = (
    "A file holding the Redis URL (its first line), read at start instead of --redis-url: "
    "a URL with a password stays off the command line, where every local user sees it "
    "(`ps`). `gtr-retrieval up` passes its Redis this way."
)


class RedisSettings(ServiceSettings):
    """A service that uses the store's Redis (the gateway, an index shard): its URL, given
    as ``--redis-url`` or read from ``--redis-url-file``, checked at start."""

    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="The store's Redis (documents, change logs, generations registry): "
        "redis://host:port/0 (rediss:// with TLS) for one Redis, "
        "redis+cluster://host:port,host:port (rediss+cluster://) for a Redis Cluster (the "
        "nodes are seeds; user:password@ before them for AUTH).",
    )
    redis_url_file: str | None = Field(None, description=REDIS_URL_FILE_HELP)

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str) -> str:
        from services.process.redis_client import check_redis_url

        return check_redis_url(value)

    @model_validator(mode="after")
    def _redis_url_file(self) -> RedisSettings:
        """The URL read from ``--redis-url-file`` replaces ``--redis-url``."""
        from services.process.redis_client import read_redis_url

        if self.redis_url_file is None:
            return self
        if "redis_url" in self.model_fields_set:
            raise ValueError("give --redis-url or --redis-url-file, not both")
        self.redis_url = read_redis_url(self.redis_url_file)
        return self


class SettingsError(SystemExit):
    """Raised (exit status 2) when the configuration is invalid; the text says why."""


S = TypeVar("S", bound=BaseSettings)


def load_settings(cls: type[S], argv: Sequence[str] | None = None, prog: str | None = None) -> S:
    """Build ``cls`` from flags (``argv``), environment and defaults, or exit with a message.

    ``argv=None`` reads no flags (environment and defaults only).
    """
    try:
        if argv is None:
            return cls()
        return cls(_cli_parse_args=list(argv), _cli_prog_name=prog)  # type: ignore[call-arg]
    except ValidationError as exc:
        lines = [f"invalid configuration for {cls.__name__}:"]
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or "(settings)"
            lines.append(f"  {where}: {err['msg']} (got {err.get('input')!r})")
        raise SettingsError("\n".join(lines)) from None
