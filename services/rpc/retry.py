"""The one retry policy of our gRPC clients: gRPC's own, set on the channel.

A client of ours inside the system that retries builds its channel with
:func:`channel_options` (the Triton encoder client). The policy is gRPC's service-config
``retryPolicy`` (gRFC A6), carried out by gRPC core for every call of the channel,
instead of a loop of ours in each client (there were two, with their own backoff and
deadline arithmetic). Why this and not a shared helper:

* one implementation for the sync API (the CLI uploads from threads) and asyncio (the
  Triton client), where a helper needs two loops;
* the attempts share the call's deadline: gRPC starts no attempt after it, so a caller
  passes its remaining time once and nothing recomputes it;
* exponential backoff with jitter (each pause is drawn uniformly from 0 to the current
  backoff), and retry *throttling*: every failure costs a token, every success returns
  ``token_ratio``, and below half of ``max_tokens`` gRPC stops retrying, so a fleet of
  clients does not multiply the load on a server that is down or overloaded;
* only an attempt that failed before the server answered is retried (a response that
  has started is never replayed).

Only for idempotent calls: every method of a channel built this way is retried. Triton's
inference and metadata calls are (the same input gives the same embedding). The codes a
client retries are its own choice: UNAVAILABLE (a server restarting or out of reach)
and, where the server means "busy, try later" by it, RESOURCE_EXHAUSTED.

The gateway's clients (the SDK, ``gtr_client``, which the CLI uses) retry by a policy of
their own (``gtr_client/retry.py``): per method (a Delete is not sent again after
UNAVAILABLE), and a refusal whose ``retry-after-ms`` outlasts the deadline is raised at
once with its hint instead of being waited out into DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

# gRPC caps maxAttempts at 5 (the first attempt included); more are silently cut to 5.
MAX_ATTEMPTS = 5


@dataclass(frozen=True)
class RetryPolicy:
    """``attempts``: the first one included (1 = no retry, at most 5)."""

    attempts: int = 4
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 1.0
    multiplier: float = 2.0
    codes: tuple[str, ...] = ("UNAVAILABLE",)
    max_tokens: int = 10  # retry throttling (gRFC A6's example values)
    token_ratio: float = 0.1
    # Requests larger than this are never retried (gRPC must keep a copy to replay them;
    # its default of 256 KiB would exclude an upsert of 64 documents of 4 KB).
    buffer_bytes: int = 64 * 1024 * 1024

    def __post_init__(self) -> None:
        if not 1 <= self.attempts <= MAX_ATTEMPTS:
            raise ValueError(f"attempts must be 1..{MAX_ATTEMPTS}, got {self.attempts}")
        if self.initial_backoff_s <= 0 or self.max_backoff_s < self.initial_backoff_s:
            raise ValueError("backoffs must be > 0 with max_backoff_s >= initial_backoff_s")
        if self.multiplier <= 0 or not self.codes:
            raise ValueError("multiplier must be > 0 and codes not empty")


def _duration(seconds: float) -> str:
    return f"{seconds:.3f}s"  # protobuf's JSON Duration: 0, 3, 6 or 9 decimals


def service_config(services: Sequence[str], policy: RetryPolicy) -> str:
    """The service config (JSON) that retries every method of ``services`` by ``policy``."""
    config: dict[str, object] = {}
    if policy.attempts > 1:
        config["methodConfig"] = [
            {
                "name": [{"service": name} for name in services],
                "retryPolicy": {
                    "maxAttempts": policy.attempts,
                    "initialBackoff": _duration(policy.initial_backoff_s),
                    "maxBackoff": _duration(policy.max_backoff_s),
                    "backoffMultiplier": policy.multiplier,
                    "retryableStatusCodes": list(policy.codes),
                },
            }
        ]
        config["retryThrottling"] = {
            "maxTokens": policy.max_tokens,
            "tokenRatio": policy.token_ratio,
        }
    return json.dumps(config)


def channel_options(services: Sequence[str], policy: RetryPolicy) -> list[tuple[str, str | int]]:
    """Channel arguments that give a channel ``policy`` for ``services``' methods."""
    return [
        ("grpc.enable_retries", 1 if policy.attempts > 1 else 0),
        ("grpc.service_config", service_config(services, policy)),
        ("grpc.per_rpc_retry_buffer_size", policy.buffer_bytes),
    ]
