"""The one retry policy (services/rpc/retry.py) as the two clients that use it see it.

The retries are gRPC core's, so they are driven over real sockets: a small real gRPC
server that fails a method a given number of times with a given code, then answers,
and counts the attempts. It stands for a Triton or a gateway that is restarting or busy
(neither can be made to fail on cue; their own error answers are tested against the
real servers in test_triton_errors.py and the gateway tests).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
import pytest

from retrieval.v1 import documents_pb2, documents_pb2_grpc
from services.client.gateway import gateway_channel, upsert
from services.common.errors import DeadlineExceeded, InvalidArgument, Unavailable
from services.encoder.runtime.triton_client import (
    KSERVE_SERVICE,
    TritonEncoder,
    TritonEncoderConfig,
)
from services.rpc.retry import RetryPolicy, channel_options, service_config


@dataclass
class Script:
    """Fail the first ``failures`` calls with ``code``, then answer ``reply``."""

    code: grpc.StatusCode
    failures: int
    reply: bytes = b""
    attempts: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def handle(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        with self.lock:
            self.attempts += 1
            attempt = self.attempts
        if attempt <= self.failures:
            context.abort(self.code, f"scripted failure {attempt}")
        return self.reply


@contextmanager
def scripted_server(service: str, method: str, script: Script) -> Iterator[str]:
    from concurrent.futures import ThreadPoolExecutor

    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    handler = grpc.unary_unary_rpc_method_handler(script.handle)  # raw bytes in and out
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service, {method: handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(0)


def _triton_encode(address: str, retries: int, timeout: float = 10.0) -> None:
    async def go() -> None:
        cfg = TritonEncoderConfig(address, retries=retries, backoff_s=0.01, backoff_max_s=0.05)
        encoder = TritonEncoder(cfg, "m", 4, 8)
        try:
            await encoder.encode(["x"], "query", timeout=timeout)
        finally:
            await encoder.close()

    asyncio.run(go())


def test_the_triton_client_retries_unavailable_up_to_its_attempts() -> None:
    script = Script(grpc.StatusCode.UNAVAILABLE, failures=100)
    with scripted_server(KSERVE_SERVICE, "ModelInfer", script) as address:
        with pytest.raises(Unavailable, match="scripted failure 4"):
            _triton_encode(address, retries=3)
    assert script.attempts == 4


def test_the_triton_client_does_not_retry_a_bad_request() -> None:
    script = Script(grpc.StatusCode.INVALID_ARGUMENT, failures=100)
    with scripted_server(KSERVE_SERVICE, "ModelInfer", script) as address:
        with pytest.raises(InvalidArgument, match="scripted failure 1"):
            _triton_encode(address, retries=3)
    assert script.attempts == 1


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED])
def test_a_cli_upsert_is_retried_until_the_gateway_takes_it(code: grpc.StatusCode) -> None:
    reply = documents_pb2.UpsertResponse(upserted=1).SerializeToString()
    script = Script(code, failures=2, reply=reply)
    docs = [documents_pb2.Document(id="a", text="x" * 1_000_000)]  # > gRPC's default 256 KiB buffer
    with scripted_server("retrieval.v1.DocumentService", "Upsert", script) as address:
        with gateway_channel(address) as channel:
            response = upsert(documents_pb2_grpc.DocumentServiceStub(channel), docs, timeout=20)
    assert response.upserted == 1 and script.attempts == 3


def test_a_cli_upsert_is_not_retried_when_the_request_is_wrong() -> None:
    script = Script(grpc.StatusCode.INVALID_ARGUMENT, failures=100)
    docs = [documents_pb2.Document(id="a", text="x")]
    with scripted_server("retrieval.v1.DocumentService", "Upsert", script) as address:
        with gateway_channel(address) as channel, pytest.raises(grpc.RpcError) as info:
            upsert(documents_pb2_grpc.DocumentServiceStub(channel), docs, timeout=20)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert script.attempts == 1


def test_retries_end_at_the_call_s_deadline() -> None:
    """Backoffs of 3 s against a 0.5 s deadline: the call ends at its deadline."""
    slow = RetryPolicy(attempts=5, initial_backoff_s=3.0, max_backoff_s=3.0)
    script = Script(grpc.StatusCode.UNAVAILABLE, failures=100)
    with scripted_server("retrieval.v1.DocumentService", "Upsert", script) as address:
        with gateway_channel(address, slow) as channel:
            start = time.monotonic()
            with pytest.raises(grpc.RpcError):
                upsert(documents_pb2_grpc.DocumentServiceStub(channel), [], timeout=0.5)
            elapsed = time.monotonic() - start
    assert elapsed < 2.0 and script.attempts <= 2


def test_the_triton_deadline_covers_every_attempt() -> None:
    script = Script(grpc.StatusCode.UNAVAILABLE, failures=100)
    with scripted_server(KSERVE_SERVICE, "ModelInfer", script) as address:

        async def go() -> None:
            cfg = TritonEncoderConfig(address, retries=4, backoff_s=3.0, backoff_max_s=3.0)
            encoder = TritonEncoder(cfg, "m", 4, 8)
            try:
                await encoder.encode(["x"], "query", timeout=0.5)
            finally:
                await encoder.close()

        start = time.monotonic()
        with pytest.raises((DeadlineExceeded, Unavailable)):
            asyncio.run(go())
        assert time.monotonic() - start < 2.0 and script.attempts <= 2


def test_policy_values_and_the_service_config() -> None:
    import json

    config = json.loads(service_config(["a.B"], RetryPolicy(attempts=3, initial_backoff_s=0.05)))
    (method,) = config["methodConfig"]
    assert method["name"] == [{"service": "a.B"}]
    assert method["retryPolicy"] == {
        "maxAttempts": 3,
        "initialBackoff": "0.050s",
        "maxBackoff": "1.000s",
        "backoffMultiplier": 2.0,
        "retryableStatusCodes": ["UNAVAILABLE"],
    }
    assert config["retryThrottling"] == {"maxTokens": 10, "tokenRatio": 0.1}
    assert json.loads(service_config(["a.B"], RetryPolicy(attempts=1))) == {}
    assert ("grpc.enable_retries", 0) in channel_options(["a.B"], RetryPolicy(attempts=1))
    for bad in (
        {"attempts": 0},
        {"attempts": 6},
        {"initial_backoff_s": 0},
        {"codes": ()},
        {"initial_backoff_s": 2.0, "max_backoff_s": 1.0},
    ):
        with pytest.raises(ValueError):
            RetryPolicy(**bad)  # type: ignore[arg-type]
