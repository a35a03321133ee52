"""The base of this project's gRPC server interceptors (:class:`HandlerInterceptor`),
apart from :mod:`services.rpc.server` so that :mod:`services.rpc.auth`, which the
client library imports for ``bearer_metadata``, does not pull in the server's health,
reflection and metrics modules."""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable

import grpc


class HandlerInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """The base of this project's server interceptors: each serves a call with a handler
    of its own built around the one the call resolved to (:meth:`wrap`). A call to a
    method no servicer has (no handler) passes through untouched, so gRPC answers it
    UNIMPLEMENTED."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        return None if handler is None else self.wrap(handler, details)

    @abc.abstractmethod
    def wrap(
        self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        """The handler that serves the call ``details`` in place of ``handler``."""
