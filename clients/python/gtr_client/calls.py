"""What the sync and the asyncio client share: where the gateway is, the call's requests
and their answers, the retry policy and a session's tokens. Each client adds only how it
sends a call and how it waits between attempts."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import grpc

from gtr_client import convert, health
from gtr_client.connection import TLS, Target
from gtr_client.errors import ApiError, InvalidArgument, error_for
from gtr_client.retry import Retrier, RetryPolicy
from gtr_client.session import SessionTokens
from gtr_client.types import (
    Consistency,
    DeleteResult,
    Document,
    Fusion,
    FusionMethod,
    Mode,
    Query,
    SearchResult,
    UpsertResult,
    WriteToken,
)
from retrieval.v1 import documents_pb2, search_pb2

log = logging.getLogger("gtr_client")

DEFAULT_TIMEOUT_S = 10.0
# An upsert encodes every document before it is stored: slower than a read.
DEFAULT_WRITE_TIMEOUT_S = 60.0

SEARCH = "/retrieval.v1.SearchService/Search"
BATCH_SEARCH = "/retrieval.v1.SearchService/BatchSearch"
UPSERT = "/retrieval.v1.DocumentService/Upsert"
DELETE = "/retrieval.v1.DocumentService/Delete"
GET = "/retrieval.v1.DocumentService/Get"
HEALTH = health.CHECK_METHOD


def _serialize(message: Any) -> bytes:
    return message.SerializeToString()  # type: ignore[no-any-return]


# Every method a client calls: its path → how its request is written and its answer read
# (None: raw bytes, the health check's, see gtr_client.health).
WIRE: dict[str, tuple[Callable[[Any], bytes] | None, Callable[[bytes], Any] | None]] = {
    SEARCH: (_serialize, search_pb2.SearchResponse.FromString),
    BATCH_SEARCH: (_serialize, search_pb2.BatchSearchResponse.FromString),
    UPSERT: (_serialize, documents_pb2.UpsertResponse.FromString),
    DELETE: (_serialize, documents_pb2.DeleteResponse.FromString),
    GET: (_serialize, documents_pb2.GetResponse.FromString),
    HEALTH: (None, None),
}


def method_name(path: str) -> str:
    """``/pkg.Service/Method`` → ``Method`` (what the retry policy and errors name)."""
    return path.rsplit("/", 1)[-1]


def error_from_rpc(exc: grpc.RpcError, method: str, attempts: int) -> ApiError:
    """The SDK's exception of a failed call (sync ``grpc.RpcError`` or asyncio
    ``AioRpcError``: both carry code, details and trailing metadata)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = (exc.details() if hasattr(exc, "details") else None) or str(exc)
    trailing = (exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None) or ()
    return error_for(code.name, details, tuple(trailing), method=method, attempts=attempts)


def as_query(query: str | Query) -> Query:
    return query if isinstance(query, Query) else Query(query)


def make_query(
    text: str,
    *,
    k: int,
    mode: Mode | str | None,
    fusion: Fusion | FusionMethod | str | None,
    filter: Mapping[str, str | Sequence[str]] | None,
    consistency: Consistency | str | None,
    write_token: WriteToken | None,
    require_complete: bool,
    rerank: bool,
    rerank_depth: int,
    nprobe: int,
    ids_only: bool,
) -> Query:
    """A :class:`Query` from a search's keyword arguments (strings for the enums taken)."""
    if isinstance(fusion, (FusionMethod, str)):
        fusion = Fusion(method=FusionMethod(fusion))
    try:
        return Query(
            text,
            k=k,
            mode=Mode(mode) if mode is not None else None,
            fusion=fusion,
            filter=filter,
            consistency=Consistency(consistency) if consistency is not None else None,
            write_token=write_token,
            require_complete=require_complete,
            rerank=rerank,
            rerank_depth=rerank_depth,
            nprobe=nprobe,
            ids_only=ids_only,
        )
    except ValueError as exc:  # an enum's unknown name
        raise InvalidArgument(str(exc)) from None


class ClientBase:
    """The state of a client, or of a session of it (which shares the connection)."""

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
    ) -> None:
        self.target = Target.resolve(address, token, tls, None if env else {})
        self.timeout = timeout
        self.write_timeout = write_timeout
        self.retrier = Retrier(retry or RetryPolicy())
        self.tokens: SessionTokens | None = None

    @property
    def address(self) -> str:
        return self.target.address

    @property
    def write_token(self) -> WriteToken | None:
        """In a session: the token its searches send (None: nothing written yet)."""
        return self.tokens.token() if self.tokens is not None else None

    def _session_state(self, parent: ClientBase, token: WriteToken | None) -> None:
        self.target = parent.target
        self.timeout = parent.timeout
        self.write_timeout = parent.write_timeout
        self.retrier = parent.retrier
        self.tokens = SessionTokens()
        if token is not None:
            self.tokens.observe(token)

    def _deadline(self, timeout: float | None, write: bool = False) -> float:
        if timeout is not None:
            return timeout
        return self.write_timeout if write else self.timeout

    # --- requests and answers -------------------------------------------------------

    def _search_request(self, query: Query) -> search_pb2.SearchRequest:
        if self.tokens is not None:
            query = self.tokens.apply(query)
        return convert.search_request(query)

    def _batch_request(self, queries: Sequence[str | Query]) -> search_pb2.BatchSearchRequest:
        return search_pb2.BatchSearchRequest(
            requests=[self._search_request(as_query(q)) for q in queries]
        )

    @staticmethod
    def _batch_results(pb: search_pb2.BatchSearchResponse) -> list[SearchResult]:
        return [convert.search_result(r) for r in pb.responses]

    @staticmethod
    def _upsert_request(
        documents: Iterable[Document | Mapping[str, Any]],
    ) -> documents_pb2.UpsertRequest:
        return documents_pb2.UpsertRequest(documents=[convert.document_to_pb(d) for d in documents])

    @staticmethod
    def _delete_request(ids: str | Iterable[str]) -> documents_pb2.DeleteRequest:
        return documents_pb2.DeleteRequest(ids=[ids] if isinstance(ids, str) else list(ids))

    def _upserted(self, pb: documents_pb2.UpsertResponse) -> UpsertResult:
        result = convert.upsert_result(pb)
        if self.tokens is not None:
            self.tokens.observe(result.write_token)
        return result

    def _deleted(self, pb: documents_pb2.DeleteResponse) -> DeleteResult:
        result = convert.delete_result(pb)
        if self.tokens is not None:
            self.tokens.observe(result.write_token)
        return result

    def _retry_pause(
        self, path: str, exc: grpc.RpcError, attempt: int, remaining_s: float
    ) -> tuple[ApiError, float | None]:
        """The failed call's exception, and the pause before sending it again (None:
        raise it)."""
        method = method_name(path)
        error = error_from_rpc(exc, method, attempt)
        pause = self.retrier.after_failure(method, error, attempt, remaining_s)
        if pause is not None:
            log.debug("%s failed (%s); attempt %d in %.3f s", method, error, attempt + 1, pause)
        return error, pause
