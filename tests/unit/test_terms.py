"""services.common.terms counts a query's words as the shards' Tantivy analyzer splits
them (issue #33 point 5): the gateway refuses a query over ``max_query_terms`` before it
encodes anything, with the count a shard would reach, and without loading tantivy."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.errors import InvalidArgument
from services.common.fusion import Mode
from services.common.limits import LIMITS
from services.common.terms import MAX_TOKEN_BYTES, check_query_terms, distinct_words, words
from services.gateway import validation
from services.gateway.domain import SearchQuery

tantivy_text = pytest.importorskip("services.index.core.text")

# letters, marks, numbers, punctuation, symbols and separators of every script, and the
# cases that matter to the tokenizer: long runs, combining marks (Other_Alphabetic),
# characters whose lowercase differs by context (final sigma) or in length (İ)
TEXT = st.text(
    alphabet=st.one_of(
        st.characters(categories=("L", "M", "N", "P", "S", "Z")),
        st.sampled_from(list("aZ09 -_.'’ΣσςİıßẞǅⅫ½²हिन्दीक़")),
    ),
    max_size=120,
) | st.lists(st.sampled_from(["a" * 38, "é" * 20, "b" * 39, "c" * 40, "x", "Σ"]), max_size=6).map(
    " ".join
)


@settings(max_examples=1500, deadline=None)
@given(TEXT)
def test_the_words_are_tantivys_tokens_before_stemming(text: str) -> None:
    tokens = tantivy_text.analyzer("none").analyze(text)
    assert words(text) == tokens


@settings(max_examples=300, deadline=None)
@given(TEXT)
def test_stemming_never_makes_more_terms_than_words(text: str) -> None:
    stems = set(tantivy_text.analyzer("english").analyze(text))
    assert len(stems) <= len(distinct_words(text))


def test_long_tokens_are_dropped_from_forty_bytes() -> None:
    assert words("a" * (MAX_TOKEN_BYTES - 1) + " " + "b" * MAX_TOKEN_BYTES) == [
        "a" * (MAX_TOKEN_BYTES - 1)
    ]


def _hybrid_query_of(n: int) -> str:
    return " ".join(f"term{i:03d}" for i in range(n))


def test_a_query_over_the_term_limit_is_refused_by_the_gateway_before_any_work() -> None:
    """The 2.3 KB, 300-word hybrid query of issue #33: refused by check_query (which the
    gateway runs before it encodes) unless the search is dense; at the limit it passes."""
    text = _hybrid_query_of(300)
    assert 2000 < len(text) < LIMITS.max_query_bytes
    for mode in (Mode.HYBRID, Mode.SPARSE, None):
        query = SearchQuery(text=text, k=10, mode=mode)  # None: the default (hybrid)
        with pytest.raises(InvalidArgument, match="query: 300 distinct terms"):
            validation.check_query(query, LIMITS, 1)
    validation.check_query(SearchQuery(text=text, k=10, mode=Mode.DENSE), LIMITS, 1)
    at_limit = _hybrid_query_of(LIMITS.max_query_terms)
    validation.check_query(SearchQuery(text=at_limit, k=10, mode=Mode.HYBRID), LIMITS, 1)
    repeated = " ".join(["same"] * 1000)
    validation.check_query(SearchQuery(text=repeated, k=10), LIMITS, 1)
    with pytest.raises(InvalidArgument, match="at most 256"):
        check_query_terms(_hybrid_query_of(257))
