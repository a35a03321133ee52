"""The one error vocabulary of the service.

The core (shard, encoder, scorer, gateway logic) raises these; it never imports grpc.
`services.rpc.server` maps them to gRPC status codes in one place (an interceptor),
so a client's retry logic can rely on the code:

=====================  =====================  ==========================
error                  gRPC status            retry?
=====================  =====================  ==========================
InvalidArgument        INVALID_ARGUMENT       no: the request is wrong
NotFound               NOT_FOUND              no
Overloaded             RESOURCE_EXHAUSTED     yes, after retry-after-ms
StoreFull              RESOURCE_EXHAUSTED     no (pushback -1): free space
Unavailable            UNAVAILABLE            yes, another replica
GenerationMoved        UNAVAILABLE            yes (the gateway does, after
                                              re-reading the alias)
DeadlineExceeded       DEADLINE_EXCEEDED      no (the budget is spent)
FailedPrecondition     FAILED_PRECONDITION    no: fix the system state
Unauthenticated        UNAUTHENTICATED        no: send a valid token
PermissionDenied       PERMISSION_DENIED      no: the token lacks the scope
=====================  =====================  ==========================

Anything else that escapes is a bug and becomes INTERNAL.
"""

from __future__ import annotations


class RetrievalError(Exception):
    """Base of every error that the service reports to a client on purpose."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(RetrievalError):
    """The request is malformed: the message says which field and why."""


class NotFound(RetrievalError):
    """A named document, model or shard does not exist."""


class Overloaded(RetrievalError):
    """A queue or a resource limit is full; the caller may retry later."""


class StoreFull(Overloaded):
    """The document store refused a write for want of memory (Redis ``maxmemory`` with
    ``noeviction``): nothing was stored; deleting documents or raising the limit frees
    room. Reported as RESOURCE_EXHAUSTED (an exhausted resource, as gRPC's codes say of a
    full disk) with gRPC's "do not retry" pushback (``grpc-retry-pushback-ms: -1``), so a
    channel that retries busy answers (the CLI's) sends the upsert once, not five times.
    Kept RESOURCE_EXHAUSTED rather than FAILED_PRECONDITION: gRPC's status guide gives
    "the entire file system is out of space" as its example; the pushback is what tells
    a retrying client that this is not the busy kind."""


class Unavailable(RetrievalError):
    """A dependency (Redis, Triton, a shard) cannot be reached right now."""


class GenerationMoved(Unavailable):
    """A write found its shard's writer gate naming another generation than the one it
    was encoded for, or closed while a switch drains (docs/generations.md). The gateway
    re-reads the alias and writes again within the deadline; only when the deadline runs
    out does a client see it, as UNAVAILABLE."""

    def __init__(self, message: str, gate: str = "") -> None:
        super().__init__(message)
        self.gate = gate


class DeadlineExceeded(RetrievalError):
    """The request's deadline passed before the work could finish."""


class FailedPrecondition(RetrievalError):
    """The system is not in a state to do this (e.g. the index is not trained)."""


class Unauthenticated(RetrievalError):
    """No bearer token, a malformed one, or one that no configured set holds. The message
    never repeats the token."""


class PermissionDenied(RetrievalError):
    """A valid token without the scope the method needs (a read token on Upsert)."""
