"""When a failed call is sent again, and after how long: one policy for the sync and the
asyncio client (each runs it in a loop of a few lines, the only difference being how it
sleeps).

What is retried, by status and method:

- RESOURCE_EXHAUSTED with the server's ``retry-after-ms`` hint: every method. The
  gateway's in-flight limit refuses a call at the front door, before any work, so even a
  write was not done. The pause is the hint itself (plus up to ``hint_jitter`` of it, so
  that the clients refused together do not come back together), never less. Without a
  hint, or with gRPC's "do not retry" pushback (a full document store), never.
- UNAVAILABLE (a gateway restarting, Redis or a shard out of reach): the reads (Search,
  BatchSearch, Get, the health check) and Upsert, with exponential backoff and full
  jitter. An upsert is a put by id: sent again it leaves the same documents and answers
  with a token of the later write, which covers both. Not Delete: a delete that was done
  before its answer was lost would come back with its ids in ``not_found`` and a write
  token without the first attempt's positions (a delete of missing ids writes nothing),
  so a session could still see the documents it deleted. A Delete that fails UNAVAILABLE
  raises :class:`~gtr_client.errors.Unavailable`; sending it again is the caller's call.
- Nothing else (a bad request, a missing document, a deadline that passed, auth).

Every attempt shares the call's deadline: no pause is begun that would end past it (the
last error is raised at once instead, so a caller told "busy, retry after 2 s" with 1 s
left gets :class:`~gtr_client.errors.ResourceExhausted` with ``retry_after_s`` rather
than a DEADLINE_EXCEEDED a second later). ``attempts`` caps the tries (the first
included), and a :class:`RetryBudget` shared by a client's calls stops retrying when most
recent calls fail (gRFC A6's retry throttling), so a fleet of clients does not multiply
the load on a gateway that is down.

Why not gRPC's own retry policy (the service config the server's internal clients use,
``services/rpc/retry.py``): it waits a pushback out to the deadline and then reports
DEADLINE_EXCEEDED instead of the refusal and its hint, and it knows nothing of
``retry-after-ms``, which an HTTP client of the same gateway reads too.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from dataclasses import dataclass

from gtr_client.errors import ApiError, ResourceExhausted, Unavailable

# Methods sent again after UNAVAILABLE (see the module's docstring for Delete).
RETRY_UNAVAILABLE = frozenset({"Search", "BatchSearch", "Get", "Upsert", "Check"})


@dataclass(frozen=True)
class RetryPolicy:
    """``attempts``: the first included (1: never retry). An UNAVAILABLE's n-th retry
    pauses a uniform draw from 0 to min(``max_backoff_s``, ``initial_backoff_s`` x
    ``multiplier`` ** (n - 1)); a RESOURCE_EXHAUSTED's pauses its hint h, h..h x (1 +
    ``hint_jitter``)."""

    attempts: int = 5
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0
    multiplier: float = 2.0
    hint_jitter: float = 0.1

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {self.attempts}")
        if self.initial_backoff_s <= 0 or self.max_backoff_s < self.initial_backoff_s:
            raise ValueError("backoffs must be > 0 with max_backoff_s >= initial_backoff_s")
        if self.multiplier < 1 or self.hint_jitter < 0:
            raise ValueError("multiplier must be >= 1 and hint_jitter >= 0")

    def pause(
        self,
        method: str,
        error: ApiError,
        attempt: int,
        remaining_s: float | None,
        draw: Callable[[], float] = random.random,
    ) -> float | None:
        """How long to wait before sending ``method`` again after its ``attempt``-th try
        failed with ``error`` and ``remaining_s`` left of its deadline (None: no
        deadline); None: do not send it again. ``draw``: uniform in [0, 1)."""
        if attempt >= self.attempts:
            return None
        if isinstance(error, ResourceExhausted):
            if error.retry_after_s is None:
                return None
            pause = error.retry_after_s * (1.0 + self.hint_jitter * draw())
        elif isinstance(error, Unavailable) and method in RETRY_UNAVAILABLE:
            ceiling = self.initial_backoff_s * self.multiplier ** (attempt - 1)
            pause = min(self.max_backoff_s, ceiling) * draw()
        else:
            return None
        if remaining_s is not None and pause >= remaining_s:
            return None
        return pause


# A policy that sends every call once.
NO_RETRY = RetryPolicy(attempts=1)


class RetryBudget:
    """Retry throttling (gRFC A6): every failure that could be retried takes a token,
    every success gives back ``token_ratio``; at or below half of ``max_tokens`` nothing
    is retried until successes refill it. Shared by every call of a client (and its
    sessions); thread-safe."""

    def __init__(self, max_tokens: float = 10.0, token_ratio: float = 0.1) -> None:
        if max_tokens <= 0 or token_ratio <= 0:
            raise ValueError("max_tokens and token_ratio must be > 0")
        self.max_tokens = max_tokens
        self.token_ratio = token_ratio
        self.tokens = max_tokens
        self._lock = threading.Lock()

    def success(self) -> None:
        with self._lock:
            self.tokens = min(self.max_tokens, self.tokens + self.token_ratio)

    def failure(self) -> bool:
        """Count a failure; whether a retry may still be sent."""
        with self._lock:
            self.tokens = max(0.0, self.tokens - 1.0)
            return self.tokens > self.max_tokens / 2


class Retrier:
    """A client's policy and budget together: what its call loops ask."""

    def __init__(self, policy: RetryPolicy, budget: RetryBudget | None = None) -> None:
        self.policy = policy
        self.budget = budget or RetryBudget()

    def after_failure(
        self, method: str, error: ApiError, attempt: int, remaining_s: float | None
    ) -> float | None:
        """The pause before the next attempt, or None: raise ``error``."""
        pause = self.policy.pause(method, error, attempt, remaining_s)
        if pause is None:
            return None
        return pause if self.budget.failure() else None

    def after_success(self) -> None:
        self.budget.success()
