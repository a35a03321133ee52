"""The Python SDK of gtr-retrieval: search, write and read documents through the gateway.

    from gtr_client import Client

    with Client("127.0.0.1:50051") as client:
        result = client.search("read a csv file", k=5)

Modules, each with one role:

``client``      :class:`Client`, the blocking client, and its sessions
``aio``         :class:`AsyncClient`, the same API for asyncio
``calls``       what both share: requests, answers, a session's state, the call's retries
``types``       the requests' options and the answers, as dataclasses (no protobuf)
``convert``     those types ↔ the wire contract's messages (the ``retrieval`` package)
``errors``      one exception per status (:class:`ApiError` and its subclasses)
``retry``       what is sent again after a failure, and when (the server's retry hint)
``session``     a session's write tokens folded into one (read-your-writes)
``connection``  address, bearer token, TLS, from arguments or ``GTR_*`` variables
``health``      the gRPC health check's two messages

The distribution also ships ``retrieval``, the generated wire contract (protos/); its
version is this SDK's (``__version__``).
"""

from __future__ import annotations

from gtr_client.aio import AsyncClient
from gtr_client.client import Client
from gtr_client.connection import TLS
from gtr_client.errors import (
    ApiError,
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    InternalError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from gtr_client.retry import NO_RETRY, RetryPolicy
from gtr_client.types import (
    Consistency,
    DeleteResult,
    Document,
    Fusion,
    FusionMethod,
    HealthStatus,
    Hit,
    Mode,
    Query,
    SearchResult,
    StageTimings,
    UpsertResult,
    WriteToken,
)
from retrieval import __version__

__all__ = [
    "NO_RETRY",
    "TLS",
    "ApiError",
    "AsyncClient",
    "Cancelled",
    "Client",
    "Consistency",
    "DeadlineExceeded",
    "DeleteResult",
    "Document",
    "FailedPrecondition",
    "Fusion",
    "FusionMethod",
    "HealthStatus",
    "Hit",
    "InternalError",
    "InvalidArgument",
    "Mode",
    "NotFound",
    "PermissionDenied",
    "Query",
    "ResourceExhausted",
    "RetryPolicy",
    "SearchResult",
    "StageTimings",
    "Unauthenticated",
    "Unavailable",
    "UpsertResult",
    "WriteToken",
    "__version__",
]
