"""The encoder as a client of Triton's ``embed`` model (KServe v2 over gRPC, asyncio).

One gRPC channel per encoder, reused by every call. Every call carries the remaining
deadline as ``client_timeout``, so Triton drops work nobody waits for.

Errors: Triton answers with gRPC status codes (tritonclient's ``InferenceServerException``
carries it as ``status()``), and they go through the service's one map,
``services/common/status.py`` (INVALID_ARGUMENT → InvalidArgument, NOT_FOUND for an
unknown model → NotFound, DEADLINE_EXCEEDED → DeadlineExceeded, …). One refinement, of
Triton's vocabulary and not ours: Triton reports a full model queue as UNAVAILABLE with
the message ``Exceeds maximum queue size`` (checked against the real server in
``tests/integration/test_triton_errors.py``); that is Overloaded (RESOURCE_EXHAUSTED),
not a server that is down.

Retries: the channel's, :mod:`services.common.retry` (gRPC's retryPolicy, UNAVAILABLE
only, within the call's deadline; every KServe call is idempotent). gRPC cannot tell a
full queue from a restart, so a full queue is retried too, with backoff and gRPC's retry
throttling (which stops retrying once failures pile up); the caller then gets Overloaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from services.common import status
from services.common.errors import (
    DeadlineExceeded,
    Overloaded,
    RetrievalError,
    Unavailable,
)
from services.common.retry import RetryPolicy, channel_options
from services.common.tls import ClientTLS
from services.encoder.base import Embeddings, Encoder, validate_request
from services.encoder.profiles import Kind

KSERVE_SERVICE = "inference.GRPCInferenceService"
# What Triton says (with UNAVAILABLE) when a model's queue is full (max_queue_size).
TRITON_QUEUE_FULL = "Exceeds maximum queue size"


@dataclass(frozen=True)
class TritonEncoderConfig:
    url: str  # host:port of Triton's gRPC endpoint
    model: str = "embed"
    default_timeout_s: float = 10.0  # used when a call passes no timeout
    retries: int = 3  # extra attempts on UNAVAILABLE (at most 4: gRPC allows 5 attempts)
    backoff_s: float = 0.05  # first backoff; doubles, with jitter
    backoff_max_s: float = 1.0
    connect_timeout_s: float = 5.0
    tls: ClientTLS | None = None  # None: plaintext gRPC to Triton

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


def triton_client(cfg: TritonEncoderConfig) -> Any:
    """An asyncio tritonclient whose channel retries by ``cfg``'s policy."""
    from tritonclient.grpc.aio import InferenceServerClient

    args = triton_channel_args(cfg.retry_policy())
    if cfg.tls is None:
        return InferenceServerClient(cfg.url, channel_args=args)
    # Triton started with --grpc-use-ssl (and --grpc-use-ssl-mutual for mTLS)
    return InferenceServerClient(
        cfg.url, creds=cfg.tls.credentials(), channel_args=[*args, *cfg.tls.options()]
    )


class TritonEncoder(Encoder):
    """:class:`Encoder` backed by Triton; build it with :meth:`connect`."""

    def __init__(
        self, client: Any, cfg: TritonEncoderConfig, model_name: str, dim: int, max_batch: int
    ) -> None:
        self._client = client
        self.cfg = cfg
        self.model_name = model_name
        self.dim = dim
        self.max_batch = max_batch

    @classmethod
    async def connect(cls, cfg: TritonEncoderConfig) -> TritonEncoder:
        """Open the channel and read model name, dim and max batch from the model config."""
        client = triton_client(cfg)
        try:
            response = await client.get_model_config(
                cfg.model, client_timeout=cfg.connect_timeout_s
            )
        except Exception as exc:
            await client.close()
            raise map_triton_error(exc, f"reading config of {cfg.model!r} at {cfg.url}") from exc
        config = response.config
        params = {k: v.string_value for k, v in config.parameters.items()}
        dims = {o.name: list(o.dims) for o in config.output}
        dim = int(params.get("dim") or dims.get("EMBEDDING", [0])[-1])
        if dim <= 0:
            await client.close()
            raise Unavailable(f"model {cfg.model!r} at {cfg.url} declares no EMBEDDING width")
        name = params.get("source_model") or cfg.model
        return cls(client, cfg, name, dim, int(config.max_batch_size) or 1)

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
        try:
            result = await self._client.infer(
                self.cfg.model, inputs, outputs=outputs, client_timeout=budget
            )
        except Exception as exc:
            raise map_triton_error(exc, f"embedding {len(items)} texts") from exc
        vectors = np.asarray(result.as_numpy("EMBEDDING"), dtype=np.float32)
        truncated = np.asarray(result.as_numpy("TRUNCATED")).reshape(-1)
        return Embeddings(vectors.reshape(len(items), self.dim), [bool(t) for t in truncated])

    async def close(self) -> None:
        await self._client.close()
