"""The one place where domain errors become gRPC status codes (and, for the gateway's
HTTP/JSON port, those codes HTTP statuses)."""

from __future__ import annotations

import re

import grpc

from services.common import errors

STATUS_OF: dict[type[errors.RetrievalError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
}

ERROR_OF: dict[grpc.StatusCode, type[errors.RetrievalError]] = {
    code: cls for cls, code in STATUS_OF.items()
}


# The hint of when to retry a RESOURCE_EXHAUSTED, for any client (a person, a script).
RETRY_AFTER_KEY = "retry-after-ms"
# gRPC's own server pushback (gRFC A6), read by the retry policy of a client's channel
# (the CLI's, services/rpc/retry.py): a count of ms makes gRPC wait exactly that long
# before its next attempt instead of its own backoff; a negative value means "do not
# retry this call".
PUSHBACK_KEY = "grpc-retry-pushback-ms"


def trailing_metadata(exc: errors.RetrievalError) -> tuple[tuple[str, str], ...]:
    """What a refusal tells a retrying client. A full store (StoreFull, still
    RESOURCE_EXHAUSTED: a resource is exhausted) says "no retry": the next attempt would
    be refused the same way until documents are deleted or the limit raised, and each
    one resends the whole upsert. An error with a ``retry_after_ms`` hint (the in-flight
    limit's refusal) gives it under both keys. Anything else: nothing, the client's own
    backoff applies."""
    if isinstance(exc, errors.StoreFull):
        return ((PUSHBACK_KEY, "-1"),)
    hint = getattr(exc, "retry_after_ms", None)
    if hint is None:
        return ()
    return ((RETRY_AFTER_KEY, str(hint)), (PUSHBACK_KEY, str(hint)))


# gRPC code -> HTTP status, as google/rpc/code.proto documents each code's mapping (the
# one gRPC's HTTP/JSON transcoding uses).
HTTP_STATUS_OF: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNKNOWN: 500,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DATA_LOSS: 500,
}


def http_status(code: grpc.StatusCode) -> int:
    """The HTTP status of a gRPC code (500 for one the table lacks)."""
    return HTTP_STATUS_OF.get(code, 500)


def retry_after_ms(exc: errors.RetrievalError) -> int | None:
    """The retry hint of an error (the in-flight limit's refusal), None without one (a
    full store's refusal has none: retrying sooner would not help)."""
    if isinstance(exc, errors.StoreFull):
        return None
    hint = getattr(exc, "retry_after_ms", None)
    return int(hint) if hint is not None else None


def http_headers(exc: errors.RetrievalError) -> dict[str, str]:
    """What an HTTP refusal tells a retrying client: ``Retry-After`` in whole seconds (what
    HTTP allows; rounded up, at least 1) and the exact hint as ``retry-after-ms``, the
    key gRPC's trailing metadata uses."""
    hint = retry_after_ms(exc)
    if hint is None:
        return {}
    return {"Retry-After": str(max(1, -(-hint // 1000))), RETRY_AFTER_KEY: str(hint)}


# An internal address in an error's text: ``host:port`` (a name with a letter in it,
# dotted IPv4 or bracketed IPv6), with its scheme (``redis://``, ``dns:///``, gRPC's
# ``ipv4:``), credentials and path if any. A shard's, Triton's, Redis's or the reranker's.
_ADDRESS = re.compile(
    r"(?:\b[a-z][a-z0-9+.-]*:/{2,3}|\bipv[46]:)?"  # scheme
    r"(?:[^\s/@]+@)?"  # user:password@
    r"(?:\[[0-9A-Fa-f:.]+\]"  # [IPv6]
    r"|\b\d{1,3}(?:\.\d{1,3}){3}"  # IPv4
    r"|\b(?=[A-Za-z0-9.-]*[A-Za-z])[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?)"  # a name
    r":\d{1,5}\b(?:/[^\s,;)]*)?"  # :port and a path
)
# ... and the forms Python's socket errors use: ``('127.0.0.1', 6379)``, a bare IPv4
_SOCKET_ADDRESS = re.compile(
    r"\(\s*['\"][^'\"]*['\"]\s*,\s*\d{1,5}(?:\s*,\s*\d+)*\s*\)|\b\d{1,3}(?:\.\d{1,3}){3}\b"
)
INTERNAL_ADDRESS = "<internal>"


def public_message(message: str) -> str:
    """``message`` as a client of the public gateway may read it: every internal address
    replaced by ``<internal>`` (an inner hop's error names the replica, server or store it
    came from; which shard stays, ``shard 1 replica <internal>: ...``). The gateway logs
    the whole text (:class:`services.rpc.server.ErrorAndLatencyInterceptor`)."""
    return _SOCKET_ADDRESS.sub(INTERNAL_ADDRESS, _ADDRESS.sub(INTERNAL_ADDRESS, message))


def status_of(exc: errors.RetrievalError) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        if cls in STATUS_OF:
            return STATUS_OF[cls]  # type: ignore[index]
    return grpc.StatusCode.INTERNAL


def error_from_rpc(exc: grpc.RpcError, what: str) -> errors.RetrievalError:
    """Turn a failed call to one of our own internal services back into a domain error.

    Used by clients inside the system (gateway → shard, gateway → rerank) so that an
    error keeps its meaning across a hop: a shard's INVALID_ARGUMENT stays one.
    """
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return _error(code, details, what)


def _error(code: grpc.StatusCode, details: str, what: str) -> errors.RetrievalError:
    """A code's domain error (an unknown code or INTERNAL: Unavailable, retry elsewhere)."""
    return ERROR_OF.get(code, errors.Unavailable)(f"{what}: {details}")


def error_from_code(code: grpc.StatusCode, details: str, what: str) -> errors.RetrievalError:
    """The domain error of a status code reported by a server that is not ours (Triton):
    the same map as :func:`error_from_rpc`, for clients that hand over the code alone."""
    return _error(code, details, what)


_CODE_OF_NUMBER: dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}
_CODE_OF_NAME: dict[str, grpc.StatusCode] = {c.name: c for c in grpc.StatusCode}


def code_of_name(name: str | None) -> grpc.StatusCode:
    """``"StatusCode.UNAVAILABLE"`` (``str(code)``, as tritonclient reports it) or
    ``"UNAVAILABLE"`` → the code; anything else (None, a typo) → UNKNOWN."""
    key = (name or "").strip().removeprefix("StatusCode.")
    return _CODE_OF_NAME.get(key, grpc.StatusCode.UNKNOWN)


def status_number(exc: BaseException) -> tuple[int, str]:
    """(gRPC status code number, message) of an error, for answers carried in a message.

    A domain error keeps its code; anything else is a bug and becomes INTERNAL.
    """
    if isinstance(exc, errors.RetrievalError):
        return int(status_of(exc).value[0]), exc.message
    return int(grpc.StatusCode.INTERNAL.value[0]), f"internal error: {type(exc).__name__}"


def error_from_status(number: int, message: str, what: str) -> errors.RetrievalError:
    """The domain error for a status code number carried in a message (see status_number)."""
    return _error(_CODE_OF_NUMBER.get(number, grpc.StatusCode.UNKNOWN), message, what)
