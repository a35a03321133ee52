"""The encoder as a client of Triton's ``embed`` model (KServe v2 over gRPC, asyncio).

One gRPC channel per encoder, reused by every call. Every call carries the remaining
deadline as ``client_timeout``, so Triton drops work nobody waits for. Only
UNAVAILABLE (connection refused or reset, server restarting) is retried, with
exponential backoff, and only while the deadline allows. A full queue comes back as
UNAVAILABLE too but means *overloaded*: it is not retried here (retrying at once
adds load); the caller gets Overloaded and decides.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from services.common.errors import (
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    Overloaded,
    RetrievalError,
    Unavailable,
)
from services.encoder.base import Embeddings, Encoder, validate_request
from services.encoder.profiles import Kind


@dataclass(frozen=True)
class TritonEncoderConfig:
    url: str  # host:port of Triton's gRPC endpoint
    model: str = "embed"
    default_timeout_s: float = 10.0  # used when a call passes no timeout
    retries: int = 3  # extra attempts on UNAVAILABLE
    backoff_s: float = 0.05  # first backoff; doubles, with jitter
    backoff_max_s: float = 1.0
    connect_timeout_s: float = 5.0


def map_triton_error(exc: Exception, what: str) -> RetrievalError:
    """Triton/gRPC error → the service's error vocabulary (never a bare INTERNAL)."""
    status = str(getattr(exc, "status", lambda: "")() or "")
    message = str(getattr(exc, "message", lambda: str(exc))() or exc)
    text = f"{what}: {message}"
    if "DEADLINE_EXCEEDED" in status or "Deadline Exceeded" in message:
        return DeadlineExceeded(text)
    if "INVALID_ARGUMENT" in status:
        return InvalidArgument(text)
    if "RESOURCE_EXHAUSTED" in status or ("queue" in message.lower() and "UNAVAILABLE" in status):
        return Overloaded(text)
    if "NOT_FOUND" in status or "unknown model" in message.lower():
        return NotFound(text)
    return Unavailable(text)


def _retryable(exc: Exception, mapped: RetrievalError) -> bool:
    return isinstance(mapped, Unavailable) and "UNAVAILABLE" in str(
        getattr(exc, "status", lambda: "")()
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
        from tritonclient.grpc.aio import InferenceServerClient

        client = InferenceServerClient(cfg.url)
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
        deadline = time.monotonic() + budget
        backoff = self.cfg.backoff_s
        for attempt in range(self.cfg.retries + 1):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DeadlineExceeded(f"no time left to embed {len(items)} texts ({budget:.3f} s)")
            try:
                result = await self._client.infer(
                    self.cfg.model, inputs, outputs=outputs, client_timeout=remaining
                )
            except Exception as exc:
                mapped = map_triton_error(exc, f"embedding {len(items)} texts")
                pause = min(backoff, self.cfg.backoff_max_s) * (0.5 + random.random())
                if (not _retryable(exc, mapped) or attempt == self.cfg.retries
                        or time.monotonic() + pause >= deadline):  # fmt: skip
                    raise mapped from exc
                await asyncio.sleep(pause)
                backoff *= 2
                continue
            vectors = np.asarray(result.as_numpy("EMBEDDING"), dtype=np.float32)
            truncated = np.asarray(result.as_numpy("TRUNCATED")).reshape(-1)
            return Embeddings(vectors.reshape(len(items), self.dim), [bool(t) for t in truncated])
        raise Unavailable("unreachable: retry loop ended")  # pragma: no cover

    async def close(self) -> None:
        await self._client.close()
