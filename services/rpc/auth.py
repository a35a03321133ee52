"""Bearer-token authentication and authorisation of the public API (a server interceptor).

A client sends ``authorization: Bearer <token>`` in the call's metadata. Two sets of
tokens are configured from files (one token per line; blank lines and ``#`` comments
ignored), typically a Kubernetes Secret mounted as files:

- read tokens: ``Search``, ``BatchSearch``, ``Get``;
- write tokens: ``Upsert``, ``Delete``, and everything a read token may do.

No token, a malformed header or a token that no set holds → UNAUTHENTICATED; a read
token on a write method → PERMISSION_DENIED (the errors of :mod:`services.common.errors`,
mapped to codes in :mod:`services.rpc.status`, like every other error). The gRPC
health service and reflection stay open, so probes and ``grpcurl list`` need no token.
A method in none of :data:`METHOD_SCOPES` needs a write token (closed by default).

The presented token is hashed (SHA-256) and compared with :func:`hmac.compare_digest`
against the digest of *every* configured token, with no early exit: neither the time
taken nor the length of a token tells which one, or how much of one, matched. Tokens are
never logged and never put in an error message.

The files are re-read when they change (a Secret rotated by the kubelet, which swaps a
symlink: the path's inode and mtime change), checked at most every
``reload_interval_s`` on the request path (one ``stat``), so a rotation needs no restart.
A file that becomes unreadable or empty keeps its previous tokens (a half-written file
must not lock every client out); the change is logged, without the tokens.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import logging
import os
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from services.common import errors
from services.rpc.interceptors import HandlerInterceptor

log = logging.getLogger(__name__)

AUTH_HEADER = "authorization"
BEARER = "bearer "
# Never authenticated: probes and reflection must answer without a token.
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class Scope(enum.Enum):
    READ = "read"
    WRITE = "write"


# The one table of which scope each public method needs.
METHOD_SCOPES: dict[str, Scope] = {
    "/retrieval.v1.SearchService/Search": Scope.READ,
    "/retrieval.v1.SearchService/BatchSearch": Scope.READ,
    "/retrieval.v1.DocumentService/Get": Scope.READ,
    "/retrieval.v1.DocumentService/Upsert": Scope.WRITE,
    "/retrieval.v1.DocumentService/Delete": Scope.WRITE,
}


def scope_of(method: str) -> Scope | None:
    """The scope ``method`` needs; None for the open ones (health, reflection)."""
    if method.startswith(OPEN_PREFIXES):
        return None
    return METHOD_SCOPES.get(method, Scope.WRITE)


def parse_tokens(text: str) -> list[str]:
    """One token per line; blank lines and ``#`` comments ignored; surrounding space cut."""
    tokens = []
    for line in text.splitlines():
        token = line.split("#", 1)[0].strip()
        if token:
            tokens.append(token)
    return tokens


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


@dataclass
class TokenFile:
    """The tokens of one file, re-read when the file changes (checked at most every
    ``reload_interval_s``). :meth:`load` at start raises ValueError when the file cannot
    be read or holds no token; later reloads keep the previous tokens instead."""

    path: Path
    reload_interval_s: float = 1.0
    digests: tuple[bytes, ...] = ()
    _stamp: tuple[int, int, int] | None = field(default=None, repr=False)
    _checked_at: float = field(default=0.0, repr=False)

    def load(self) -> TokenFile:
        try:
            self._read(os.stat(self.path))
        except OSError as exc:
            raise ValueError(f"token file {self.path}: {exc.strerror or exc}") from None
        if not self.digests:
            raise ValueError(f"token file {self.path} holds no token")
        return self

    def _read(self, st: os.stat_result) -> None:
        tokens = parse_tokens(self.path.read_text(encoding="utf-8"))
        self._stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        if tokens:
            self.digests = tuple(_digest(t) for t in tokens)
        elif self.digests:
            log.warning("token file %s holds no token: the previous tokens are kept", self.path)

    def current(self) -> tuple[bytes, ...]:
        """The digests of the file's tokens, re-read first when it changed."""
        now = time.monotonic()
        if now - self._checked_at >= self.reload_interval_s:
            self._checked_at = now
            try:
                st = os.stat(self.path)
                if (st.st_ino, st.st_mtime_ns, st.st_size) != self._stamp:
                    before = len(self.digests)
                    self._read(st)
                    log.info(
                        "token file %s changed: %d tokens (was %d)",
                        self.path,
                        len(self.digests),
                        before,
                    )
            except (OSError, UnicodeDecodeError) as exc:
                log.warning("token file %s unreadable, previous tokens kept: %s", self.path, exc)
        return self.digests


def _matches(digest: bytes, digests: Sequence[bytes]) -> bool:
    """Whether ``digest`` is one of ``digests``; compares with every one (no early exit)."""
    found = False
    for candidate in digests:
        found |= hmac.compare_digest(digest, candidate)
    return found


@dataclass
class Authenticator:
    """The configured token sets; :meth:`check` says whether a call may proceed."""

    read: Sequence[TokenFile] = ()
    write: Sequence[TokenFile] = ()

    @classmethod
    def from_files(
        cls, read: str | None, write: str | None, reload_interval_s: float = 1.0
    ) -> Authenticator:
        """From a read and a write token file (either may be None, not both)."""
        if not read and not write:
            raise ValueError("no token file: give a read or a write token file")

        def files(path: str | None) -> list[TokenFile]:
            return [TokenFile(Path(path), reload_interval_s).load()] if path else []

        return cls(files(read), files(write))

    def check(self, method: str, metadata: Iterable[tuple[str, Any]] | None) -> None:
        """Raise Unauthenticated or PermissionDenied unless ``metadata`` carries a token
        with the scope ``method`` needs."""
        scope = scope_of(method)
        if scope is None:
            return
        token = bearer_token(metadata)
        digest = _digest(token)
        # both sets are always compared, whatever the first one says
        is_write = _matches(digest, [d for f in self.write for d in f.current()])
        is_read = _matches(digest, [d for f in self.read for d in f.current()])
        if not (is_write or is_read):
            raise errors.Unauthenticated("invalid bearer token")
        if scope is Scope.WRITE and not is_write:
            raise errors.PermissionDenied(f"{method.rsplit('/', 1)[-1]} needs a write token")


def bearer_token(metadata: Iterable[tuple[str, Any]] | None) -> str:
    """The token of the ``authorization: Bearer <token>`` entry; Unauthenticated when
    there is none or it is not a bearer token."""
    for key, value in metadata or ():
        if key.lower() == AUTH_HEADER:
            text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
            if text[: len(BEARER)].lower() == BEARER and text[len(BEARER) :].strip():
                return text[len(BEARER) :].strip()
            raise errors.Unauthenticated("the 'authorization' metadata must be 'Bearer <token>'")
    raise errors.Unauthenticated("missing bearer token ('authorization: Bearer <token>')")


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata a client sends: ``(("authorization", "Bearer <token>"),)``."""
    return ((AUTH_HEADER, f"Bearer {token}"),) if token else ()


class AuthInterceptor(HandlerInterceptor):
    """Refuses a call without the token its method needs, before its handler runs.

    Put it after :class:`services.rpc.server.ErrorAndLatencyInterceptor` (inner): a
    refused call gets a handler that raises the domain error, which the outer interceptor
    maps to its status code and counts in the RPC metrics like any other outcome.
    """

    def __init__(self, authenticator: Authenticator) -> None:
        self._auth = authenticator

    def wrap(
        self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        try:
            self._auth.check(details.method, details.invocation_metadata)
        except errors.RetrievalError as exc:
            return _refusing(handler, exc)
        return handler


def _refusing(handler: grpc.RpcMethodHandler, error: errors.RetrievalError) -> Any:
    """A handler of the same shape as ``handler`` that raises ``error``."""

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        raise error

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        raise error
        yield  # pragma: no cover - makes this an async generator

    parse, serialize = handler.request_deserializer, handler.response_serializer
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(unary, parse, serialize)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(stream, parse, serialize)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(unary, parse, serialize)
    return grpc.stream_stream_rpc_method_handler(stream, parse, serialize)
