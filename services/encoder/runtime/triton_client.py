"""The encoder as a client of Triton's ``embed`` model (KServe v2 over gRPC, asyncio).

Triton's servers: one address, a list (``host:port,host:port``) or a DNS name re-resolved
(``dns:///gtr-triton-headless.ns.svc:8001``: the chart's headless Service, whose A
records are the ready Triton pods). Each server gets a gRPC channel of its own and an
encode goes to the one with the fewest encodes outstanding from this process (ties in
turn), as the index router picks a shard's replica: the balancing, the DNS watch and
the suspicion of a failing server are :mod:`services.rpc.balance`'s, shared with it.
One channel to a Kubernetes Service would send every encode of a gateway to one pod
(gRPC keeps one HTTP/2 connection per channel): measured with two Triton servers under
a closed loop, ``python -m bench.triton_balance``.

An encode that a server refuses as unavailable (a pod that died or is restarting, after
the channel's own retries) or overloaded (a full queue) is sent to the next server in
the order, within the same deadline; a server that misses ``suspect_after`` encodes in
a row is asked last until Triton says the model is ready there again. Every call
carries the remaining deadline as ``client_timeout``, so Triton drops work nobody waits
for.

Errors: Triton answers with gRPC status codes (tritonclient's ``InferenceServerException``
carries it as ``status()``), and they go through the service's one map,
``services/rpc/status.py`` (INVALID_ARGUMENT → InvalidArgument, NOT_FOUND for an
unknown model → NotFound, DEADLINE_EXCEEDED → DeadlineExceeded, …). One refinement, of
Triton's vocabulary and not ours: Triton reports a full model queue as UNAVAILABLE with
the message ``Exceeds maximum queue size`` (checked against the real server in
``tests/integration/test_triton_errors.py``); that is Overloaded (RESOURCE_EXHAUSTED),
not a server that is down.

Versions: one Triton model (``embed``) may serve several encoder versions side by side
(``encoder publish`` adds the next one; docs/generations.md). A request that names no
version gets Triton's newest, so an encoder that names none would silently change model
the moment a new version is published: :meth:`TritonEncoder.connect` therefore **pins**
the version, ``TritonEncoderConfig.model_version`` or, when that is empty, the newest
version ready at connect time, and sends it on every infer and readiness probe. A server
that answers NOT_FOUND for the pinned version has not loaded it (a pod whose copy of the
repository lags): that is Unavailable there, and the next server is asked. The
pinned version, its source model and its digest are the encoder's ``model_version``,
``model_name`` and ``digest``: what a generation records and what the query cache keys
on. The CPU ``embed`` answers them itself on its optional output ``ENCODER`` (read from
the version folder's ``version.json``, so that publishing a version never changes the
config, whose change would make Triton reload the serving version too); a model without
that output (the GPU ensemble, a repository of an older generator) is read from its
config's parameters (``version.<n>.*`` over the shared ones).

Retries: the channel's, :mod:`services.rpc.retry` (gRPC's retryPolicy, UNAVAILABLE
only, within the call's deadline; every KServe call is idempotent). gRPC cannot tell a
full queue from a restart, so a full queue is retried too, with backoff and gRPC's retry
throttling (which stops retrying once failures pile up); then the next server is asked,
and with none left the caller gets Overloaded.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import grpc
import numpy as np

from services.common.errors import (
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    Overloaded,
    RetrievalError,
    Unavailable,
)
from services.encoder.base import Embeddings, Encoder, validate_request, version_key
from services.encoder.profiles import Kind
from services.rpc import status
from services.rpc.balance import Balancing, Endpoint, EndpointPool, reconnect_options, tls_for
from services.rpc.discovery import is_dns_target, parse_addresses, parse_dns_target
from services.rpc.retry import RetryPolicy, channel_options
from services.rpc.tls import ClientTLS, Rotating
from services.telemetry import tracing
from services.telemetry.tracing import CLIENT

KSERVE_SERVICE = "inference.GRPCInferenceService"
# What Triton says (with UNAVAILABLE) when a model's queue is full (max_queue_size).
TRITON_QUEUE_FULL = "Exceeds maximum queue size"


def triton_addresses(url: str) -> list[str]:
    """``host:port``, ``host:port,host:port`` or one ``dns:`` target → the addresses
    (ValueError saying what is wrong)."""
    return parse_addresses(url, "Triton")


@dataclass(frozen=True)
class TritonEncoderConfig:
    # Triton's gRPC endpoint(s): host:port, host:port,host:port, or dns:///name:port
    url: str
    model: str = "embed"
    # Triton's version of ``model`` to ask ("2"); "": the newest ready at connect, pinned
    model_version: str = ""
    # Triton request priority sent on every infer (1 = first; a model config generated
    # with priority_levels 2 has default 1; without levels Triton ignores it): 0 = the
    # model's default. The index builder sends 2 (DOCUMENT_PRIORITY) so that, with the
    # levels, queries go before its batches.
    priority: int = 0
    default_timeout_s: float = 10.0  # used when a call passes no timeout
    retries: int = 3  # extra attempts on UNAVAILABLE (at most 4: gRPC allows 5 attempts)
    backoff_s: float = 0.05  # first backoff; doubles, with jitter
    backoff_max_s: float = 1.0
    connect_timeout_s: float = 5.0
    tls: ClientTLS | None = None  # None: plaintext gRPC to Triton
    balancing: Balancing = field(default_factory=Balancing)
    suspect_after: int = 3  # misses in a row before a server is asked last
    probe_every_s: float = 0.5  # how often a suspect server's model readiness is asked

    def retry_policy(self) -> RetryPolicy:
        return RetryPolicy(
            attempts=self.retries + 1,
            initial_backoff_s=self.backoff_s,
            max_backoff_s=max(self.backoff_s, self.backoff_max_s),
        )


def map_triton_error(exc: Exception, what: str) -> RetrievalError:
    """A Triton/tritonclient error → the service's error, by its gRPC status code."""
    code = status.code_of_name(getattr(exc, "status", lambda: None)())
    message = str(getattr(exc, "message", lambda: None)() or exc)
    if code is grpc.StatusCode.UNAVAILABLE and TRITON_QUEUE_FULL in message:
        return Overloaded(f"{what}: {message}")
    return status.error_from_code(code, message, what)


def triton_channel_args(policy: RetryPolicy) -> list[tuple[str, Any]]:
    """tritonclient's own channel defaults (message sizes, keepalive) + the retry policy."""
    from tritonclient.grpc import MAX_GRPC_MESSAGE_SIZE, KeepAliveOptions

    keepalive = KeepAliveOptions()
    return [
        ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
        ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE),
        ("grpc.keepalive_time_ms", keepalive.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", keepalive.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", keepalive.keepalive_permit_without_calls),
        ("grpc.http2.max_pings_without_data", keepalive.http2_max_pings_without_data),
        *channel_options([KSERVE_SERVICE], policy),
    ]


def triton_client(
    cfg: TritonEncoderConfig, address: str | None = None, tls: ClientTLS | None = None
) -> Any:
    """An asyncio tritonclient to ``address`` (default ``cfg.url``, one server) whose
    channel retries by ``cfg``'s policy; TLS by ``tls`` (default ``cfg.tls``)."""
    from tritonclient.grpc.aio import InferenceServerClient

    address = address or cfg.url
    tls = tls or cfg.tls
    args = [*triton_channel_args(cfg.retry_policy()), *reconnect_options(cfg.probe_every_s)]
    if tls is None:
        return InferenceServerClient(address, channel_args=args)
    # Triton started with --grpc-use-ssl (and --grpc-use-ssl-mutual for mTLS)
    return InferenceServerClient(
        address, creds=tls.credentials(), channel_args=[*args, *tls.options()]
    )


class TritonServer(Endpoint):
    """One Triton server of the pool: its client (own channel) and its readiness (of the
    pinned model version). The client is rebuilt when the TLS files change on disk
    (:class:`Rotating`); the old one is closed once its calls ended."""

    def __init__(self, address: str, cfg: TritonEncoderConfig, tls: ClientTLS | None) -> None:
        super().__init__(address, f"triton {address}", cfg.suspect_after, cfg.probe_every_s)
        self.cfg = cfg
        self.tls = tls
        self.clients: Rotating[Any] = Rotating(
            lambda: triton_client(cfg, address, tls), _close_client, tls, self.what
        )

    @property
    def client(self) -> Any:
        return self.clients.current

    async def serving(self) -> bool:
        timeout = max(self.cfg.probe_every_s, 0.1)
        with self.clients.use() as client:
            return bool(
                await client.is_model_ready(
                    self.cfg.model, self.cfg.model_version, client_timeout=timeout
                )
            )

    async def close(self) -> None:
        await super().close()
        await self.clients.close()


async def _close_client(client: Any) -> None:
    await client.close()


def pin_version(pool: EndpointPool[TritonServer], cfg: TritonEncoderConfig) -> None:
    """Make ``pool``'s servers, now and those found later, probe ``cfg``'s version."""
    for server in pool.endpoints:
        server.cfg = cfg
    make = pool.make

    def pinned(address: str) -> TritonServer:
        server = make(address)
        server.cfg = cfg
        return server

    pool.make = pinned


@dataclass(frozen=True)
class ModelVersionInfo:
    """What the model config says about one version of the model."""

    version: int
    source_model: str  # the checkpoint's name (or the Triton model's, if none recorded)
    dim: int
    digest: str  # of the version's graph(s) and tokenizer; "" for a repository from before


def version_params(params: dict[str, str], version: int) -> dict[str, str]:
    """The model-wide parameters overlaid with version ``version``'s (``version.<n>.key``),
    as the Python-backend models see them (``triton_models/model_errors.py``
    ``version_params``: a model file cannot import this package, so the rule is there
    twice; ``tests/unit/test_encoder_versions.py`` checks both give the same)."""
    prefix = version_key(version, "")
    own = {k[len(prefix) :]: v for k, v in params.items() if k.startswith(prefix)}
    return {**{k: v for k, v in params.items() if not k.startswith("version.")}, **own}


def describe_version(config: Any, version: int, model: str) -> ModelVersionInfo:
    """:class:`ModelVersionInfo` of ``version`` from a ``ModelConfig`` (protobuf)."""
    params = version_params({k: v.string_value for k, v in config.parameters.items()}, version)
    dims = {o.name: list(o.dims) for o in config.output}
    dim = int(params.get("dim") or dims.get("EMBEDDING", [0])[-1])
    return ModelVersionInfo(
        version, params.get("source_model") or model, dim, params.get("digest", "")
    )


ENCODER_OUTPUT = "ENCODER"  # the CPU embed's optional output: its version's description


async def read_version_info(
    server: TritonServer, cfg: TritonEncoderConfig, config: Any, version: int
) -> ModelVersionInfo:
    """:class:`ModelVersionInfo` of ``version`` at ``server``: asked of the model itself
    when it has the ``ENCODER`` output (a one-row request that runs no graph), else read
    from ``config`` (:func:`describe_version`)."""
    if ENCODER_OUTPUT not in {o.name for o in config.output}:
        return describe_version(config, version, cfg.model)
    import json

    from tritonclient.grpc import InferInput, InferRequestedOutput

    inputs = []
    for name, value in (("TEXT", b"describe"), ("KIND", b"query")):
        column = InferInput(name, [1, 1], "BYTES")
        column.set_data_from_numpy(np.array([[value]], dtype=object))
        inputs.append(column)
    result = await server.client.infer(
        cfg.model,
        inputs,
        model_version=str(version),
        outputs=[InferRequestedOutput(ENCODER_OUTPUT)],
        client_timeout=cfg.connect_timeout_s,
    )
    own = json.loads(np.asarray(result.as_numpy(ENCODER_OUTPUT)).reshape(-1)[0])
    base = describe_version(config, version, cfg.model)
    return ModelVersionInfo(
        version,
        own.get("source_model") or base.source_model,
        int(own.get("dim") or base.dim),
        own.get("digest") or "",
    )


def newest_version(versions: Sequence[str]) -> int | None:
    """The highest numbered of Triton's version strings (the one an unversioned request
    gets), or None."""
    numbers = [int(v) for v in versions if str(v).isdigit()]
    return max(numbers) if numbers else None


def triton_pool(cfg: TritonEncoderConfig) -> EndpointPool[TritonServer]:
    """Triton's servers named by ``cfg.url`` (a DNS target's servers are checked against
    the DNS name's certificate under TLS)."""
    addresses = triton_addresses(cfg.url)
    target = parse_dns_target(addresses[0]) if is_dns_target(addresses[0]) else None
    tls = tls_for(cfg.tls, target)
    return EndpointPool(
        "triton", addresses, lambda address: TritonServer(address, cfg, tls), cfg.balancing
    )


async def _read_version(server: TritonServer, cfg: TritonEncoderConfig) -> tuple[Any, int]:
    """(model config, version) from ``server``: ``cfg.model_version`` if it is ready
    there, else the newest ready version when none is asked for; Unavailable otherwise."""
    timeout = cfg.connect_timeout_s
    client = server.client
    response = await client.get_model_config(cfg.model, client_timeout=timeout)
    metadata = await client.get_model_metadata(cfg.model, client_timeout=timeout)
    ready = sorted(int(v) for v in metadata.versions if str(v).isdigit())
    if cfg.model_version:
        if not cfg.model_version.isdigit() or int(cfg.model_version) < 1:
            raise InvalidArgument(
                f"model_version {cfg.model_version!r} is not a Triton version (1, 2, ...)"
            )
        version = int(cfg.model_version)
        if not await client.is_model_ready(cfg.model, str(version), client_timeout=timeout):
            raise Unavailable(
                f"version {version} of model {cfg.model!r} is not ready at {server.address} "
                f"(ready: {ready or 'none'}); publish it with `gtr-retrieval encoder publish`"
            )
        return response.config, version
    newest = newest_version([str(v) for v in ready])
    if newest is None:
        raise Unavailable(f"model {cfg.model!r} has no ready version at {server.address}")
    return response.config, newest


class TritonEncoder(Encoder):
    """:class:`Encoder` backed by Triton's servers; build it with :meth:`connect`."""

    def __init__(
        self,
        cfg: TritonEncoderConfig,
        model_name: str,
        dim: int,
        max_batch: int,
        pool: EndpointPool[TritonServer] | None = None,
    ) -> None:
        self.cfg = cfg
        self.pool = pool if pool is not None else triton_pool(cfg)
        self.model_name = model_name
        self.dim = dim
        self.max_batch = max_batch
        # the pinned Triton model version (0: none pinned, Triton's newest is asked) and
        # its digest ("" when the repository records none)
        self.model_version = int(cfg.model_version) if cfg.model_version.isdigit() else 0
        self.digest = ""

    @classmethod
    async def connect(cls, cfg: TritonEncoderConfig) -> TritonEncoder:
        """Find the servers, pin the model version (``cfg.model_version``, or the newest
        ready one) after checking that it is ready, and read its name, dim, digest and
        the max batch from the model config (of the first server that answers).

        A version that is not ready (not published, not loaded yet, or failed to load)
        is Unavailable naming the versions that are; an unknown model is NotFound."""
        pool = triton_pool(cfg)
        try:
            try:
                async with asyncio.timeout(cfg.connect_timeout_s):
                    servers = await pool.current()
            except TimeoutError:
                raise Unavailable(f"triton: {cfg.url} not resolved in time") from None
            if not servers:
                raise Unavailable(f"triton: {cfg.url} names no server")
            error: RetrievalError = Unavailable(f"triton: no server at {cfg.url}")
            for server in pool.order(servers):
                try:
                    config, version = await _read_version(server, cfg)
                    info = await read_version_info(server, cfg, config, version)
                    break
                except Exception as exc:
                    error = (
                        exc
                        if isinstance(exc, RetrievalError)
                        else map_triton_error(
                            exc, f"reading config of {cfg.model!r} at {server.address}"
                        )
                    )
                    if not isinstance(error, Unavailable | DeadlineExceeded):
                        raise error from exc
            else:
                raise error
            if info.dim <= 0:
                raise Unavailable(f"model {cfg.model!r} at {cfg.url} declares no EMBEDDING width")
            pinned = replace(cfg, model_version=str(version))
            pin_version(pool, pinned)
        except BaseException:
            await pool.close()
            raise
        encoder = cls(pinned, info.source_model, info.dim, int(config.max_batch_size) or 1, pool)
        encoder.model_version = version
        encoder.digest = info.digest
        return encoder

    def _inputs(self, texts: list[str], kind: Kind) -> list[Any]:
        from tritonclient.grpc import InferInput

        text_in = InferInput("TEXT", [len(texts), 1], "BYTES")
        text_in.set_data_from_numpy(
            np.array([t.encode("utf-8") for t in texts], dtype=object).reshape(-1, 1)
        )
        kind_in = InferInput("KIND", [len(texts), 1], "BYTES")
        kind_in.set_data_from_numpy(np.full((len(texts), 1), kind.encode(), dtype=object))
        return [text_in, kind_in]

    async def encode(
        self, texts: Sequence[str], kind: Kind, timeout: float | None = None
    ) -> Embeddings:
        items = validate_request(texts, kind, self.max_batch)
        from tritonclient.grpc import InferRequestedOutput

        inputs = self._inputs(items, kind)
        outputs = [InferRequestedOutput("EMBEDDING"), InferRequestedOutput("TRUNCATED")]
        budget = self.cfg.default_timeout_s if timeout is None else timeout
        if budget <= 0:
            raise DeadlineExceeded(f"no time left to embed {len(items)} texts ({budget:.3f} s)")
        until = time.monotonic() + budget
        servers = self.pool.known()  # no timer for what is known (as the shard router)
        if servers is None:  # a dns: target's first resolution, within the call's deadline
            try:
                async with asyncio.timeout(budget):
                    servers = await self.pool.current()
            except TimeoutError:
                raise DeadlineExceeded(f"triton: {self.cfg.url} not resolved in time") from None
        if not servers:
            raise Unavailable(f"triton: {self.cfg.url} names no server")
        error: RetrievalError = Unavailable(f"triton: no server at {self.cfg.url}")
        for server in self.pool.order(servers):
            left = until - time.monotonic()
            if left <= 0:
                raise DeadlineExceeded(f"embedding {len(items)} texts: no time left ({error})")
            started = time.monotonic()
            server.sent()
            try:
                with server.clients.use() as client, tracing.span("triton infer", CLIENT) as span:
                    if span:
                        span.set_attributes({"gtr.model": self.cfg.model, "gtr.texts": len(items)})
                    result = await client.infer(
                        self.cfg.model,
                        inputs,
                        model_version=self.cfg.model_version,
                        outputs=outputs,
                        client_timeout=left,
                        priority=self.cfg.priority,
                        headers=tracing.outgoing_headers(),  # Triton joins the trace
                    )
            except Exception as exc:
                error = map_triton_error(exc, f"embedding {len(items)} texts at {server.address}")
                if isinstance(error, NotFound) and self.cfg.model_version:
                    # this server lacks the pinned version (a pod whose repository copy
                    # has not got it yet): not the caller's mistake, another may have it
                    error = Unavailable(f"{error.message} (not loaded on this server)")
                if isinstance(error, Overloaded):
                    continue  # full: the next server may not be
                if isinstance(error, Unavailable | DeadlineExceeded):
                    server.missed(error.message)
                if isinstance(error, Unavailable):
                    continue  # down or restarting: fail over at once
                raise error from exc
            finally:
                server.done()
            server.answered(time.monotonic() - started)
            vectors = np.asarray(result.as_numpy("EMBEDDING"), dtype=np.float32)
            truncated = np.asarray(result.as_numpy("TRUNCATED")).reshape(-1)
            return Embeddings(vectors.reshape(len(items), self.dim), [bool(t) for t in truncated])
        raise error

    async def close(self) -> None:
        await self.pool.close()
