"""What a caller asks for and what the gateway answers, as plain dataclasses.

Nothing here imports grpc or protobuf: :mod:`gtr_client.convert` turns these into the
wire contract's messages (``retrieval.v1``) and back. Every field's meaning is the one
written in ``protos/retrieval/v1/*.proto``; where the proto uses 0 or "" for "not set"
(a rank, a skipped rerank's reason, the model of a sparse search) these types use None.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


class Mode(enum.StrEnum):
    """The first stage of a search (``RetrievalMode``)."""

    DENSE = "dense"  # the query embedding against IVF-PQ
    SPARSE = "sparse"  # BM25 over title + text; the query is not encoded
    HYBRID = "hybrid"  # both lists, fused


class FusionMethod(enum.StrEnum):
    """How a hybrid search fuses its dense and sparse lists (``FusionMethod``)."""

    RRF = "rrf"  # reciprocal-rank fusion: sum of 1 / (rrf_k + rank)
    WEIGHTED = "weighted"  # dense_weight x dense + (1 - dense_weight) x sparse, min-max normalised


class Consistency(enum.StrEnum):
    """How fresh a search must be with respect to acknowledged writes (``Consistency``)."""

    EVENTUAL = "eventual"  # what each shard has applied now
    SESSION = "session"  # read-your-writes: wait for a write token's positions
    STRONG = "strong"  # wait for every write acknowledged before the search started


class HealthStatus(enum.StrEnum):
    """The gRPC health service's answer (``grpc.health.v1``)."""

    UNKNOWN = "unknown"
    SERVING = "serving"
    NOT_SERVING = "not_serving"
    SERVICE_UNKNOWN = "service_unknown"


@dataclass(frozen=True)
class Fusion:
    """A hybrid search's fusion; every field left at its default is the gateway's choice.

    ``method`` None: the gateway's default method (or WEIGHTED when only ``dense_weight``
    is set); ``rrf_k`` 0: 60; ``dense_weight`` None: 0.5; ``candidates`` 0: max(k, rerank
    depth, 100) taken from each list before fusing. Sent with a dense or sparse search it
    is INVALID_ARGUMENT.
    """

    method: FusionMethod | None = None
    rrf_k: int = 0
    dense_weight: float | None = None
    candidates: int = 0


@dataclass(frozen=True)
class Document:
    """A document as stored: ``id`` (1..256 bytes of UTF-8), ``text`` (non-empty; at most
    1 MiB with the title), optional ``title`` and string ``metadata`` (usable in filters)."""

    id: str
    text: str
    title: str = ""
    metadata: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class WriteToken:
    """Where an Upsert or Delete was written: the change-log position on each shard it
    touched (``"ms-seq"``), the index generation whose logs those are and the alias epoch
    the write was taken in. Pass it to a search with SESSION consistency to read your own
    writes; a :class:`~gtr_client.Client` session does that for you."""

    positions: Mapping[int, str] = field(default_factory=dict)
    generation: str = ""
    epoch: int = 0

    def __bool__(self) -> bool:
        return bool(self.positions) or bool(self.epoch)


@dataclass(frozen=True)
class Query:
    """One search and every option the gateway takes (``SearchRequest``).

    ``k`` 1..1000 hits; ``mode`` None: the gateway's default (hybrid unless configured
    otherwise); ``fusion`` for a hybrid search; ``filter``: metadata key → accepted
    values (every key must match; a string is one value); ``consistency`` None: EVENTUAL,
    or SESSION when a ``write_token`` is given (in a session: SESSION with the session's
    token once it has written); ``require_complete``: a shard that misses the deadline
    fails the search instead of a partial answer; ``rerank`` with ``rerank_depth`` 0:
    as deep as the deadline allows; ``nprobe`` 0: the server's default; ``ids_only``:
    hits without title, text or metadata.
    """

    text: str
    k: int = 10
    mode: Mode | None = None
    fusion: Fusion | None = None
    filter: Mapping[str, str | Sequence[str]] | None = None
    consistency: Consistency | None = None
    write_token: WriteToken | None = None
    require_complete: bool = False
    rerank: bool = False
    rerank_depth: int = 0
    nprobe: int = 0
    ids_only: bool = False


@dataclass(frozen=True)
class Hit:
    """One result. ``score`` is the final score (the reranker's when reranked);
    ``first_stage_score`` the first stage's (the fused score of a hybrid search);
    ``dense_rank`` / ``sparse_rank``: the 1-based rank in the merged dense and sparse
    lists of a hybrid or sparse search, None when the hit is not in that list (and always
    None for a dense search). Title, text and metadata are empty with ``ids_only``."""

    id: str
    score: float
    first_stage_score: float = 0.0
    title: str = ""
    text: str = ""
    metadata: Mapping[str, str] = field(default_factory=dict)
    shard: int = 0
    dense_rank: int | None = None
    sparse_rank: int | None = None


@dataclass(frozen=True)
class StageTimings:
    """Wall time the gateway spent per stage, in milliseconds."""

    encode_ms: float = 0.0
    search_ms: float = 0.0
    fetch_ms: float = 0.0
    rerank_ms: float = 0.0
    total_ms: float = 0.0


@dataclass(frozen=True)
class SearchResult:
    """A search's answer. Iterating it (and ``len``) goes over its hits.

    ``partial``: some shards did not answer in time (``missing_shards``) or answered
    without their sparse list (``sparse_missing_shards``); ``model``: the encoder that
    embedded the query (None for a sparse search, not encoded); ``generation``: the index
    generation that answered; ``mode`` and ``fusion``: the first stage that answered (the
    fusion of a hybrid one); ``reranked`` with ``rerank_depth`` candidates, or
    ``rerank_skipped_reason`` when a rerank asked for did not fit the deadline;
    ``query_truncated``: the query was longer than the model reads; ``embedding_cached``:
    the query embedding came from the gateway's cache.
    """

    hits: tuple[Hit, ...] = ()
    partial: bool = False
    missing_shards: tuple[int, ...] = ()
    sparse_missing_shards: tuple[int, ...] = ()
    model: str | None = None
    generation: str = ""
    mode: Mode | None = None
    fusion: Fusion | None = None
    timings: StageTimings = field(default_factory=StageTimings)
    query_truncated: bool = False
    reranked: bool = False
    rerank_depth: int = 0
    rerank_skipped_reason: str | None = None
    embedding_cached: bool = False

    @property
    def rerank_skipped(self) -> bool:
        return self.rerank_skipped_reason is not None

    @property
    def ids(self) -> list[str]:
        return [hit.id for hit in self.hits]

    def __iter__(self) -> Iterator[Hit]:
        return iter(self.hits)

    def __len__(self) -> int:
        return len(self.hits)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able values (enums as their names' values)."""
        return plain(self)  # type: ignore[no-any-return]


@dataclass(frozen=True)
class UpsertResult:
    """``upserted`` documents (all of the request: an upsert is all or nothing), of which
    ``truncated`` were longer than the model reads (stored whole, embedded cut)."""

    upserted: int
    truncated: int
    write_token: WriteToken


@dataclass(frozen=True)
class DeleteResult:
    """``deleted`` documents; ``not_found``: requested ids that did not exist."""

    deleted: int
    not_found: tuple[str, ...]
    write_token: WriteToken


def plain(value: Any) -> Any:
    """``value`` as JSON-able Python values: dataclasses as dicts, enums as their values,
    tuples as lists, mappings with string keys."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value
