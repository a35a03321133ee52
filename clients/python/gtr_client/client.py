"""The blocking client: :class:`Client`, and its sessions.

    from gtr_client import Client, Document

    with Client("127.0.0.1:50051") as client:
        for hit in client.search("read a csv file", k=5):
            print(hit.score, hit.id, hit.title)

A client holds one gRPC channel and is safe to share between threads. Every call has a
deadline (``timeout`` seconds; the client's ``timeout``, or ``write_timeout`` for upserts
and deletes, when not given) that covers its retries (:mod:`gtr_client.retry`), and
raises an :mod:`gtr_client.errors` exception when it fails.
"""

from __future__ import annotations

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


class Client(ClientBase):
    """A client of the gateway's public API.

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
        self._channel: grpc.Channel = self.target.channel(options)
        self._owns_channel = True
        self._rpcs: dict[str, Callable[..., Any]] = {
            path: self._channel.unary_unary(
                path, request_serializer=write, response_deserializer=read
            )
            for path, (write, read) in WIRE.items()
        }

    # --- lifetime -----------------------------------------------------------------------

    def close(self) -> None:
        """Close the channel (a session's close leaves its client's channel open)."""
        if self._owns_channel:
            self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def session(self, token: WriteToken | None = None) -> Client:
        """A session of this client: the same connection, and every search that names no
        consistency reads the writes made through the session (SESSION consistency with
        the tokens of its upserts and deletes, folded into one: read-your-writes with no
        bookkeeping). ``token``: writes made elsewhere to read too (another process's
        ``write_token``, a session's :attr:`write_token` passed on). Before its first
        write it searches as the client does."""
        child = Client.__new__(Client)
        child._session_state(self, token)
        child._channel = self._channel
        child._owns_channel = False
        child._rpcs = self._rpcs
        return child

    # --- the API ------------------------------------------------------------------------

    def search(
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
        return self.search_query(q, timeout=timeout)

    def search_query(self, query: Query, *, timeout: float | None = None) -> SearchResult:
        """:meth:`search` of a :class:`Query` built beforehand."""
        request = self._search_request(query)
        response: search_pb2.SearchResponse = self._call(SEARCH, request, timeout)
        return convert.search_result(response)

    def batch_search(
        self, queries: Sequence[str | Query], *, timeout: float | None = None
    ) -> list[SearchResult]:
        """Several searches in one call (1..64; k summed at most 10,000), encoded and
        searched as one batch; the i-th result answers the i-th query. A string is a
        :class:`Query` with its defaults (k = 10)."""
        response: search_pb2.BatchSearchResponse = self._call(
            BATCH_SEARCH, self._batch_request(queries), timeout
        )
        return self._batch_results(response)

    def upsert(
        self,
        documents: Iterable[Document | Mapping[str, Any]],
        *,
        timeout: float | None = None,
    ) -> UpsertResult:
        """Insert or replace 1..256 documents by id, all or nothing (one invalid document
        changes nothing). Mappings with ``id``, ``text``, ``title``, ``metadata`` are
        taken too."""
        response: documents_pb2.UpsertResponse = self._call(
            UPSERT, self._upsert_request(documents), timeout, write=True
        )
        return self._upserted(response)

    def delete(self, ids: str | Iterable[str], *, timeout: float | None = None) -> DeleteResult:
        """Delete documents by id (1..1024); ids that do not exist are reported in
        ``not_found``, not an error."""
        response: documents_pb2.DeleteResponse = self._call(
            DELETE, self._delete_request(ids), timeout, write=True
        )
        return self._deleted(response)

    def get(self, id: str, *, timeout: float | None = None) -> Document:
        """One document; :class:`~gtr_client.errors.NotFound` when the id does not exist."""
        response: documents_pb2.GetResponse = self._call(
            GET, documents_pb2.GetRequest(id=id), timeout
        )
        return convert.document_from_pb(response.document)

    def health(self, service: str = "", *, timeout: float | None = None) -> HealthStatus:
        """The gateway's health (``service`` "": the server as a whole; or
        ``"retrieval.v1.SearchService"``, ...): NOT_SERVING while its document store is
        out of reach or it is stopping."""
        raw: bytes = self._call(HEALTH, health.request(service), timeout)
        return health.status(raw)

    # --- one call, with its retries -----------------------------------------------------

    def _call(self, path: str, request: Any, timeout: float | None, write: bool = False) -> Any:
        budget = self._deadline(timeout, write)
        deadline = time.monotonic() + budget
        rpc = self._rpcs[path]
        attempt = 0
        while True:
            attempt += 1
            try:
                response = rpc(
                    request,
                    timeout=max(deadline - time.monotonic(), 0.0),
                    metadata=self.target.metadata,
                )
            except grpc.RpcError as exc:
                error, pause = self._retry_pause(path, exc, attempt, deadline - time.monotonic())
                if pause is None:
                    raise error from None
                time.sleep(pause)
                continue
            self.retrier.after_success()
            return response
