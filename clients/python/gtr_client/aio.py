"""The asyncio client: :class:`AsyncClient`, and its sessions; the same API as the
blocking :class:`~gtr_client.Client`, every call a coroutine.

    from gtr_client import AsyncClient

    async with AsyncClient("127.0.0.1:50051") as client:
        result = await client.search("read a csv file", k=5)

Make it inside the event loop that uses it (a gRPC asyncio channel belongs to one loop).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any

import grpc

from gtr_client import convert, health
from gtr_client.calls import (
    BATCH_SEARCH,
    DEFAULT_TIMEOUT_S,
    DEFAULT_WRITE_TIMEOUT_S,
    DELETE,
    GET,
    HEALTH,
    SEARCH,
    UPSERT,
    WIRE,
    ClientBase,
    make_query,
)
from gtr_client.connection import TLS
from gtr_client.retry import RetryPolicy
from gtr_client.types import (
    Consistency,
    DeleteResult,
    Document,
    Fusion,
    FusionMethod,
    HealthStatus,
    Mode,
    Query,
    SearchResult,
    UpsertResult,
    WriteToken,
)
from retrieval.v1 import documents_pb2, search_pb2


class AsyncClient(ClientBase):
    """An asyncio client of the gateway's public API (the arguments are
    :class:`~gtr_client.Client`'s).

    ``address`` ``host:port`` (default: ``$GTR_GATEWAY_ADDRESS``, else 127.0.0.1:50051);
    ``token`` the bearer token (default ``$GTR_TOKEN``); ``tls`` a :class:`TLS`, True for
    TLS with the system's roots, False for plaintext (default: ``$GTR_TLS_CA`` /
    ``$GTR_TLS_CLIENT_CERT`` / ``$GTR_TLS_CLIENT_KEY``, plaintext without them);
    ``env=False`` reads no environment variable. ``retry``: when calls are sent again
    (:class:`~gtr_client.retry.RetryPolicy`; ``NO_RETRY`` never).
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        token: str | None = None,
        tls: TLS | bool | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        write_timeout: float = DEFAULT_WRITE_TIMEOUT_S,
        retry: RetryPolicy | None = None,
        env: bool = True,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        super().__init__(
            address,
            token=token,
            tls=tls,
            timeout=timeout,
            write_timeout=write_timeout,
            retry=retry,
            env=env,
        )
        self._channel: grpc.aio.Channel = self.target.aio_channel(options)
        self._owns_channel = True
        self._rpcs: dict[str, Callable[..., Any]] = {
            path: self._channel.unary_unary(
                path, request_serializer=write, response_deserializer=read
            )
            for path, (write, read) in WIRE.items()
        }

    # --- lifetime -----------------------------------------------------------------------

    async def close(self) -> None:
        """Close the channel (a session's close leaves its client's channel open)."""
        if self._owns_channel:
            await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def session(self, token: WriteToken | None = None) -> AsyncClient:
        """A session of this client: the same connection, and every search that names no
        consistency reads the writes made through the session (SESSION consistency with
        the tokens of its upserts and deletes, folded into one: read-your-writes with no
        bookkeeping). ``token``: writes made elsewhere to read too (another process's
        ``write_token``, a session's :attr:`write_token` passed on). Before its first
        write it searches as the client does."""
        child = AsyncClient.__new__(AsyncClient)
        child._session_state(self, token)
        child._channel = self._channel
        child._owns_channel = False
        child._rpcs = self._rpcs
        return child

    # --- the API ------------------------------------------------------------------------

    async def search(
        self,
        query: str,
        *,
        k: int = 10,
        mode: Mode | str | None = None,
        fusion: Fusion | FusionMethod | str | None = None,
        filter: Mapping[str, str | Sequence[str]] | None = None,
        consistency: Consistency | str | None = None,
        write_token: WriteToken | None = None,
        require_complete: bool = False,
        rerank: bool = False,
        rerank_depth: int = 0,
        nprobe: int = 0,
        ids_only: bool = False,
        timeout: float | None = None,
    ) -> SearchResult:
        """The ``k`` best documents for ``query``; every option as :class:`Query` says."""
        q = make_query(
            query,
            k=k,
            mode=mode,
            fusion=fusion,
            filter=filter,
            consistency=consistency,
            write_token=write_token,
            require_complete=require_complete,
            rerank=rerank,
            rerank_depth=rerank_depth,
            nprobe=nprobe,
            ids_only=ids_only,
        )
        return await self.search_query(q, timeout=timeout)

    async def search_query(self, query: Query, *, timeout: float | None = None) -> SearchResult:
        """:meth:`search` of a :class:`Query` built beforehand."""
        request = self._search_request(query)
        response: search_pb2.SearchResponse = await self._call(SEARCH, request, timeout)
        return convert.search_result(response)

    async def batch_search(
        self, queries: Sequence[str | Query], *, timeout: float | None = None
    ) -> list[SearchResult]:
        """Several searches in one call (1..64; k summed at most 10,000), encoded and
        searched as one batch; the i-th result answers the i-th query. A string is a
        :class:`Query` with its defaults (k = 10)."""
        response: search_pb2.BatchSearchResponse = await self._call(
            BATCH_SEARCH, self._batch_request(queries), timeout
        )
        return self._batch_results(response)

    async def upsert(
        self,
        documents: Iterable[Document | Mapping[str, Any]],
        *,
        timeout: float | None = None,
    ) -> UpsertResult:
        """Insert or replace 1..256 documents by id, all or nothing (one invalid document
        changes nothing). Mappings with ``id``, ``text``, ``title``, ``metadata`` are
        taken too."""
        response: documents_pb2.UpsertResponse = await self._call(
            UPSERT, self._upsert_request(documents), timeout, write=True
        )
        return self._upserted(response)

    async def delete(
        self, ids: str | Iterable[str], *, timeout: float | None = None
    ) -> DeleteResult:
        """Delete documents by id (1..1024); ids that do not exist are reported in
        ``not_found``, not an error."""
        response: documents_pb2.DeleteResponse = await self._call(
            DELETE, self._delete_request(ids), timeout, write=True
        )
        return self._deleted(response)

    async def get(self, id: str, *, timeout: float | None = None) -> Document:
        """One document; :class:`~gtr_client.errors.NotFound` when the id does not exist."""
        response: documents_pb2.GetResponse = await self._call(
            GET, documents_pb2.GetRequest(id=id), timeout
        )
        return convert.document_from_pb(response.document)

    async def health(self, service: str = "", *, timeout: float | None = None) -> HealthStatus:
        """The gateway's health (``service`` "": the server as a whole; or
        ``"retrieval.v1.SearchService"``, ...): NOT_SERVING while its document store is
        out of reach or it is stopping."""
        raw: bytes = await self._call(HEALTH, health.request(service), timeout)
        return health.status(raw)

    # --- one call, with its retries -----------------------------------------------------

    async def _call(
        self, path: str, request: Any, timeout: float | None, write: bool = False
    ) -> Any:
        budget = self._deadline(timeout, write)
        deadline = time.monotonic() + budget
        rpc = self._rpcs[path]
        attempt = 0
        while True:
            attempt += 1
            try:
                response = await rpc(
                    request,
                    timeout=max(deadline - time.monotonic(), 0.0),
                    metadata=self.target.metadata,
                )
            except grpc.RpcError as exc:
                error, pause = self._retry_pause(path, exc, attempt, deadline - time.monotonic())
                if pause is None:
                    raise error from None
                await asyncio.sleep(pause)
                continue
            self.retrier.after_success()
            return response
