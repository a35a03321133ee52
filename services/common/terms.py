"""The words of a query as the shards' text index splits them, counted without tantivy.

The limit ``max_query_terms`` (:mod:`services.common.limits`) is on a sparse or hybrid
query's **distinct words**: the tokens of Tantivy's simple tokenizer (runs of Unicode
alphanumeric characters, Rust's ``char::is_alphanumeric``: Alphabetic or Numeric),
those of 40 bytes or more dropped (Tantivy's ``RemoveLongFilter``, before lowercasing),
lowercased character by character (Tantivy's ``LowerCaser``: no final-sigma rule). That
is the shard's analyzer before its stemmer (``services/index/core/text.py``); stemming
only merges words, so the shard's stems are never more. The gateway checks the limit
before it encodes anything and a shard checks the same count again, so a query is
refused at the gateway or not at all. Pure Python (the ``regex`` module's Unicode
properties): the gateway loads no tantivy (tests/unit/test_gateway_imports.py);
tests/unit/test_terms.py checks the two agree on generated texts.
"""

from __future__ import annotations

import regex

from services.common.errors import InvalidArgument
from services.common.limits import LIMITS, Limits

# Tantivy's RemoveLongFilter(40) as the shards configure it: a token of 40 bytes or more
# (UTF-8, before lowercasing) is not indexed, so not counted
MAX_TOKEN_BYTES = 40

_TOKEN = regex.compile(r"[\p{Alphabetic}\p{Nd}\p{Nl}\p{No}]+")


def words(text: str) -> list[str]:
    """The tokens of ``text`` in order, lowercased, as the shards' analyzer makes them
    before stemming (repeats kept)."""
    out = []
    for match in _TOKEN.finditer(text):
        token = match.group()
        if len(token.encode("utf-8")) >= MAX_TOKEN_BYTES:
            continue
        out.append("".join(c.lower() for c in token))
    return out


def distinct_words(text: str) -> list[str]:
    """The distinct words of ``text``, in order of their first appearance."""
    return list(dict.fromkeys(words(text)))


def check_query_terms(text: str, limits: Limits = LIMITS, where: str = "") -> None:
    """InvalidArgument when ``text`` has more distinct words than a sparse query may."""
    count = len(distinct_words(text))
    if count > limits.max_query_terms:
        raise InvalidArgument(
            f"{where}query: {count} distinct terms, a sparse or hybrid search takes at most "
            f"{limits.max_query_terms}"
        )
