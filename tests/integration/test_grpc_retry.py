"""The retry policy of the server's internal clients (services/rpc/retry.py) as the
Triton encoder client sees it. (The SDK, the gateway's client, has a policy of its own:
tests/integration/test_sdk_retry.py.)

The retries are gRPC core's, so they are driven over real sockets: a small real gRPC
server that fails a method a given number of times with a given code, then answers,
and counts the attempts. It stands for a Triton that is restarting or busy (it cannot
be made to fail on cue; its own error answers are tested against the real server in
test_triton_errors.py).
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from services.common.errors import DeadlineExceeded, InvalidArgument, Unavailable
from services.encoder.runtime.triton_client import (
    KSERVE_SERVICE,
    TritonEncoder,
    TritonEncoderConfig,
)
from services.rpc.retry import RetryPolicy, channel_options, service_config
from tests.support.scripted import Script, scripted_server


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
