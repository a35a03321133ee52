"""Validation of public requests, with messages that name the field and the rule.

Every function here raises :class:`~services.common.errors.InvalidArgument` on the first
problem it finds, before anything is encoded or written, so a bad request changes nothing.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Mapping, Sequence

from services.common.errors import InvalidArgument
from services.common.fusion import Mode, RetrievalDefaults
from services.common.limits import Limits
from services.common.terms import check_query_terms
from services.gateway.domain import Consistency, Document, FieldCondition, SearchQuery

# Unicode categories refused in ids: Cc (C0, DEL, C1), line and paragraph separators.
_CONTROL = frozenset({"Cc", "Zl", "Zp"})


def _utf8_len(value: str, where: str) -> int:
    try:
        return len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidArgument(f"{where}: not valid UTF-8 (lone surrogate)") from None


def _check_id(doc_id: str, where: str, limits: Limits) -> None:
    size = _utf8_len(doc_id, where)
    if size == 0:
        raise InvalidArgument(f"{where}: must not be empty")
    if size > limits.max_id_bytes:
        raise InvalidArgument(f"{where}: {size} bytes, at most {limits.max_id_bytes} allowed")
    if any(unicodedata.category(c) in _CONTROL for c in doc_id):
        raise InvalidArgument(
            f"{where}: must not contain control characters (C0, DEL, C1 such as U+0085, "
            "line or paragraph separators)"
        )
    if doc_id != doc_id.strip():
        raise InvalidArgument(f"{where}: must not be blank or start or end with whitespace")


def check_query(
    query: SearchQuery,
    limits: Limits,
    num_shards: int,
    where: str = "",
    default_mode: Mode = RetrievalDefaults.mode,
) -> None:
    """``default_mode``: the mode a query that names none gets (the gateway's
    --default-mode): fusion parameters are refused unless the resolved mode is hybrid."""
    text = query.text
    if not text.strip():
        raise InvalidArgument(f"{where}query: must not be empty")
    size = _utf8_len(text, f"{where}query")
    if size > limits.max_query_bytes:
        raise InvalidArgument(
            f"{where}query: {size} bytes, at most {limits.max_query_bytes} allowed"
        )
    if not 1 <= query.k <= limits.max_k:
        raise InvalidArgument(f"{where}k: {query.k} is out of range 1..{limits.max_k}")
    if query.nprobe > limits.max_nprobe:
        raise InvalidArgument(f"{where}nprobe: {query.nprobe} exceeds {limits.max_nprobe}")
    check_filter(query.filter, limits, where)
    if query.consistency is Consistency.SESSION and not query.write_token:
        raise InvalidArgument(
            f"{where}write_token: required with CONSISTENCY_SESSION (pass the token of "
            "your Upsert/Delete)"
        )
    for shard in query.write_token:
        if not 0 <= shard < num_shards:
            raise InvalidArgument(
                f"{where}write_token: shard {shard} does not exist (0..{num_shards - 1})"
            )
    if (
        query.rerank
        and query.rerank_depth
        and not (query.k <= query.rerank_depth <= limits.max_rerank_depth)
    ):
        raise InvalidArgument(
            f"{where}rerank.depth: {query.rerank_depth} must be 0 (auto) or in "
            f"k..{limits.max_rerank_depth}"
        )
    if query.candidates and not query.k <= query.candidates <= limits.max_k:
        raise InvalidArgument(
            f"{where}fusion.candidates: {query.candidates} must be 0 (auto) or in k..{limits.max_k}"
        )
    mode = query.mode or default_mode
    _check_fusion_mode(query, mode, where)
    if mode is not Mode.DENSE:  # a shard counts the same words again (services.common.terms)
        check_query_terms(text, limits, where)


def _check_fusion_mode(query: SearchQuery, mode: Mode, where: str) -> None:
    """Only a hybrid search fuses: fusion parameters sent with a dense or sparse search
    would be silently dropped, so they are refused (the CLI refuses its flags alike)."""
    if mode is Mode.HYBRID or (query.fusion is None and not query.candidates):
        return
    field = "fusion" if query.fusion is not None else "fusion.candidates"
    named = "" if query.mode is not None else " (the gateway's default, --default-mode)"
    raise InvalidArgument(
        f"{where}{field}: only a hybrid search fuses; this search's mode is "
        f"{mode.value}{named}: leave fusion unset, or ask for mode HYBRID"
    )


def check_filter(conditions: Sequence[FieldCondition], limits: Limits, where: str = "") -> None:
    if len(conditions) > limits.max_filter_conditions:
        raise InvalidArgument(
            f"{where}filter.must: {len(conditions)} conditions, at most "
            f"{limits.max_filter_conditions}"
        )
    for i, cond in enumerate(conditions):
        at = f"{where}filter.must[{i}]"
        if not cond.key or _utf8_len(cond.key, at) > limits.max_key_bytes:
            raise InvalidArgument(f"{at}.key: must be 1..{limits.max_key_bytes} bytes")
        if not 1 <= len(cond.any_of) <= limits.max_filter_values:
            raise InvalidArgument(
                f"{at}.any_of: needs 1..{limits.max_filter_values} values, got {len(cond.any_of)}"
            )


def check_batch(
    queries: Sequence[SearchQuery],
    limits: Limits,
    num_shards: int,
    default_mode: Mode = RetrievalDefaults.mode,
) -> None:
    if not 1 <= len(queries) <= limits.max_batch_queries:
        raise InvalidArgument(
            f"requests: {len(queries)} searches, a batch takes 1..{limits.max_batch_queries}"
        )
    for i, query in enumerate(queries):
        check_query(query, limits, num_shards, f"requests[{i}].", default_mode)
    hits = sum(q.k for q in queries)
    if hits > limits.max_batch_hits:
        raise InvalidArgument(
            f"requests: k summed over the batch: {hits}, at most {limits.max_batch_hits} "
            "(split the batch, or lower k)"
        )


def check_documents(docs: Sequence[Document], limits: Limits) -> None:
    if not 1 <= len(docs) <= limits.max_upsert_documents:
        raise InvalidArgument(
            f"documents: {len(docs)} given, an upsert takes 1..{limits.max_upsert_documents}"
        )
    seen: set[str] = set()
    for i, doc in enumerate(docs):
        at = f"documents[{i}]"
        _check_id(doc.id, f"{at}.id", limits)
        if doc.id in seen:
            raise InvalidArgument(f"{at}.id: {doc.id!r} appears twice in one request")
        seen.add(doc.id)
        if not doc.text.strip():
            raise InvalidArgument(f"{at}.text: must not be empty")
        size = _utf8_len(doc.text, f"{at}.text") + _utf8_len(doc.title, f"{at}.title")
        if size > limits.max_text_bytes:
            raise InvalidArgument(f"{at}.text: {size} bytes, at most {limits.max_text_bytes}")
        _check_metadata(doc.metadata, at, limits)


def _check_metadata(metadata: Mapping[str, str], at: str, limits: Limits) -> None:
    if len(metadata) > limits.max_metadata_keys:
        raise InvalidArgument(
            f"{at}.metadata: {len(metadata)} keys, at most {limits.max_metadata_keys}"
        )
    for key, value in metadata.items():
        if not key or _utf8_len(key, f"{at}.metadata") > limits.max_key_bytes:
            raise InvalidArgument(f"{at}.metadata: keys must be 1..{limits.max_key_bytes} bytes")
        if _utf8_len(value, f"{at}.metadata[{key}]") > limits.max_metadata_value_bytes:
            raise InvalidArgument(
                f"{at}.metadata[{key}]: at most {limits.max_metadata_value_bytes} bytes"
            )


def check_id(doc_id: str, limits: Limits, field: str = "id") -> None:
    """One document id (a Get's): the message names ``field``, not ``field[0]``."""
    _check_id(doc_id, field, limits)


def check_ids(ids: Sequence[str], limits: Limits, field: str = "ids") -> None:
    if not 1 <= len(ids) <= limits.max_delete_ids:
        raise InvalidArgument(f"{field}: {len(ids)} given, takes 1..{limits.max_delete_ids}")
    seen: set[str] = set()
    for i, doc_id in enumerate(ids):
        _check_id(doc_id, f"{field}[{i}]", limits)
        if doc_id in seen:
            raise InvalidArgument(f"{field}[{i}]: {doc_id!r} appears twice")
        seen.add(doc_id)
