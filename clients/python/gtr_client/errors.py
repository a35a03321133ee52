"""The SDK's exceptions: one class per status a caller acts on differently.

Every failed call raises an :class:`ApiError` subclass named after its gRPC status, with
the server's message (``details``, which names the field of a bad request), the method
and how many attempts were made (retries included, :mod:`gtr_client.retry`):

=====================  ======================  =========================================
exception              status                  what to do
=====================  ======================  =========================================
InvalidArgument        INVALID_ARGUMENT        fix the request (the message names the field)
NotFound               NOT_FOUND               the document does not exist
ResourceExhausted      RESOURCE_EXHAUSTED      busy: retry after ``retry_after_s`` (None:
                                               do not retry, e.g. the store is full)
Unavailable            UNAVAILABLE             a server or dependency is down: retry
DeadlineExceeded       DEADLINE_EXCEEDED       the call's deadline passed
Unauthenticated        UNAUTHENTICATED         send a valid token
PermissionDenied       PERMISSION_DENIED       the token lacks the scope (a read token
                                               writing)
FailedPrecondition     FAILED_PRECONDITION     the system is not in a state to do this
Cancelled              CANCELLED               the call was cancelled
InternalError          INTERNAL, UNKNOWN, ...  a bug on the server's side
=====================  ======================  =========================================

Nothing here imports grpc: the codes are their names, so another transport can raise the
same exceptions.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

# The server's hint of when to retry a refused call (the gateway's admission limit).
RETRY_AFTER_KEY = "retry-after-ms"
# gRPC's own server pushback (gRFC A6): the same hint, or a negative value for "do not
# retry this call" (a full document store).
PUSHBACK_KEY = "grpc-retry-pushback-ms"


class ApiError(Exception):
    """A call the gateway (or the connection to it) failed. ``code``: the gRPC status
    name; ``details``: the server's message; ``method``: the RPC (``"Search"``, ...);
    ``attempts``: how many were made; ``retry_after_s``: the server's hint of when to
    try again, when it gave one."""

    code: ClassVar[str] = "UNKNOWN"

    def __init__(
        self,
        details: str,
        *,
        method: str = "",
        attempts: int = 1,
        retry_after_s: float | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(details)
        self.details = details
        self.method = method
        self.attempts = attempts
        self.retry_after_s = retry_after_s
        if code is not None and code != type(self).code:
            self.code = code  # type: ignore[misc]  # the base class keeps a rarer code

    def __str__(self) -> str:
        where = f" ({self.method}, {self.attempts} attempts)" if self.attempts > 1 else ""
        return f"{self.code}: {self.details}{where}"


class InvalidArgument(ApiError):
    code = "INVALID_ARGUMENT"


class NotFound(ApiError):
    code = "NOT_FOUND"


class ResourceExhausted(ApiError):
    """Refused for want of room. ``retry_after_s`` is the server's hint (the gateway's
    in-flight limit refuses before doing any work, so any call may be sent again then);
    None when the server said not to retry (a full store: delete documents or raise its
    memory) or gave no hint."""

    code = "RESOURCE_EXHAUSTED"


class Unavailable(ApiError):
    code = "UNAVAILABLE"


class DeadlineExceeded(ApiError):
    code = "DEADLINE_EXCEEDED"


class Unauthenticated(ApiError):
    code = "UNAUTHENTICATED"


class PermissionDenied(ApiError):
    code = "PERMISSION_DENIED"


class FailedPrecondition(ApiError):
    code = "FAILED_PRECONDITION"


class Cancelled(ApiError):
    code = "CANCELLED"


class InternalError(ApiError):
    code = "INTERNAL"


_BY_CODE: dict[str, type[ApiError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        ResourceExhausted,
        Unavailable,
        DeadlineExceeded,
        Unauthenticated,
        PermissionDenied,
        FailedPrecondition,
        Cancelled,
        InternalError,
    )
}
# Codes the gateway never sends on purpose: a bug or a protocol mismatch.
for _code in ("UNKNOWN", "DATA_LOSS", "UNIMPLEMENTED"):
    _BY_CODE[_code] = InternalError


def retry_after(trailing: Iterable[tuple[str, str | bytes]]) -> float | None:
    """The server's hint in seconds from a call's trailing metadata: ``retry-after-ms``,
    else a non-negative ``grpc-retry-pushback-ms``; None without one, or when the
    pushback is negative (the server's "do not retry")."""
    values: dict[str, str] = {}
    for key, value in trailing:
        values[key.lower()] = (
            value.decode("ascii", "replace") if isinstance(value, bytes) else value
        )
    pushback = _milliseconds(values.get(PUSHBACK_KEY))
    if pushback is not None and pushback < 0:
        return None
    hint = _milliseconds(values.get(RETRY_AFTER_KEY))
    if hint is not None and hint >= 0:
        return hint / 1000.0
    return pushback / 1000.0 if pushback is not None else None


def _milliseconds(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(text.strip())
    except ValueError:
        return None


def error_for(
    code: str,
    details: str,
    trailing: Iterable[tuple[str, str | bytes]] = (),
    *,
    method: str = "",
    attempts: int = 1,
) -> ApiError:
    """The exception of a status ``code`` (its name, ``"NOT_FOUND"``), with the server's
    retry hint from ``trailing`` when it gave one."""
    cls = _BY_CODE.get(code, ApiError)
    return cls(
        details,
        method=method,
        attempts=attempts,
        retry_after_s=retry_after(trailing),
        code=code,
    )
