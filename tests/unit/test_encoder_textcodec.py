"""Tokenization, truncation flags and the row checks shared with the Triton models."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from services.encoder.model import default_model_dir
from services.encoder.textcodec import (
    TextCodec,
    TextError,
    check_texts,
    length_pieces,
    parse_rows,
)

KINDS = {"query", "document"}


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    tok = Tokenizer.from_file(str(default_model_dir() / "tokenizer.json"))
    return TextCodec(tok, {"query": 8, "document": 16}, pad_id=0)


def test_truncates_per_kind_and_says_so(codec: TextCodec) -> None:
    long = "one two three four five six seven eight nine ten eleven twelve"
    q = codec.encode([long, "short"], "query")
    assert q.input_ids.shape == (2, 8)
    assert q.truncated.tolist() == [True, False]
    assert q.input_ids[0, 0] == 101 and q.input_ids[0, -1] == 102  # [CLS] … [SEP] kept
    assert q.attention_mask[1].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    d = codec.encode([long], "document")
    assert d.input_ids.shape == (1, 14) and d.truncated.tolist() == [False]


def test_mixed_kinds_pad_to_the_longest_row(codec: TextCodec) -> None:
    long = "word " * 40
    batch = codec.encode_mixed([long, long], ["query", "document"])
    assert batch.input_ids.shape == (2, 16)
    assert batch.attention_mask.sum(axis=1).tolist() == [8, 16]
    assert batch.truncated.tolist() == [True, True]


def test_buckets_round_the_sequence_length_up() -> None:
    tok = Tokenizer.from_file(str(default_model_dir() / "tokenizer.json"))
    codec = TextCodec(tok, {"query": 64, "document": 64}, 0, seq_buckets=(16, 32, 64))
    assert codec.encode(["hello"], "query").input_ids.shape == (1, 16)
    assert codec.encode(["word " * 20], "query").input_ids.shape == (1, 32)


def test_unknown_kind_is_rejected(codec: TextCodec) -> None:
    with pytest.raises(TextError, match="unknown kind 'passage'"):
        codec.encode(["x"], "passage")


@pytest.mark.parametrize(
    ("texts", "kinds", "message"),
    [
        ([b""], [b"query"], "text 0 is empty"),
        ([b"ok", b"   "], [b"query"], "text 1 is empty"),
        ([b"\xff\xfe"], [b"query"], "text 0 is not valid UTF-8"),
        ([b"ok"], [b"passage"], "kind 'passage' of row 0 is unknown"),
        ([b"a", b"b", b"c"], [b"query", b"query"], "KIND has 2 rows for 3 texts"),
        ([], [b"query"], "no texts"),
    ],
)
def test_parse_rows_names_the_bad_row(texts: list[bytes], kinds: list[bytes], message: str) -> None:
    with pytest.raises(TextError, match=message):
        parse_rows(texts, kinds, KINDS)


def test_parse_rows_broadcasts_one_kind_and_decodes_utf8() -> None:
    texts, kinds = parse_rows(["ça va".encode(), b"b"], [b"Document"], KINDS)
    assert texts == ["ça va", "b"] and kinds == ["document", "document"]


def test_check_texts_limits_the_batch() -> None:
    check_texts(["a", "b"], max_batch=2)
    with pytest.raises(TextError, match="over the limit of 2"):
        check_texts(["a", "b", "c"], max_batch=2)


def test_embedders_that_read_the_same_tokenizer_bytes_share_one_codec(tmp_path: Path) -> None:
    """Building a codec holds the GIL for tens of ms (a gateway's event loop with it): a
    second version with the same tokenizer file reuses the first's; other bytes or other
    budgets build their own."""
    from services.encoder.runtime import onnx_embedder

    source = default_model_dir() / "tokenizer.json"
    copy = tmp_path / "v2" / "tokenizer.json"
    copy.parent.mkdir()
    shutil.copyfile(source, copy)
    budgets = {"query": 64, "document": 256}
    first = onnx_embedder.shared_codec(source, budgets, 0)
    assert onnx_embedder.shared_codec(copy, dict(budgets), 0) is first
    assert onnx_embedder.shared_codec(copy, {"query": 32, "document": 256}, 0) is not first
    changed = tmp_path / "v3" / "tokenizer.json"
    changed.parent.mkdir()
    changed.write_text(source.read_text().replace('"[PAD]"', '"[PAD2]"', 1))
    assert onnx_embedder.shared_codec(changed, budgets, 0) is not first
    for n in range(onnx_embedder.CODECS_KEPT):  # the least recently used is dropped
        onnx_embedder.shared_codec(source, {"query": 8 + n}, 0)
    assert onnx_embedder.shared_codec(source, budgets, 0) is not first


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 512), min_size=1, max_size=80),
    max_rows=st.integers(1, 20),
    slack=st.sampled_from([0.0, 0.1, 0.5]),
    max_tokens=st.sampled_from([0, 64, 512]),
)
def test_length_pieces_cover_every_row_once_within_their_bounds(
    lengths: list[int], max_rows: int, slack: float, max_tokens: int
) -> None:
    pieces = length_pieces(lengths, max_rows, slack, max_tokens)
    assert sorted(i for piece in pieces for i in piece) == list(range(len(lengths)))
    for piece in pieces:
        assert 1 <= len(piece) <= max_rows
        sizes = [lengths[i] for i in piece]
        padded = max(sizes) * len(piece)
        if len(piece) > 1:
            assert padded <= (1 + slack) * sum(sizes) + 1e-9
            assert not max_tokens or padded <= max_tokens


def test_length_pieces_group_rows_of_one_length_in_arrival_order_apart() -> None:
    """Short and long rows interleaved: each piece holds one kind, in full pieces."""
    lengths = [10, 200] * 12
    pieces = length_pieces(lengths, 8)
    assert [len(p) for p in pieces] == [8, 4, 8, 4]
    assert {lengths[i] for i in pieces[0] + pieces[1]} == {10}
    assert {lengths[i] for i in pieces[2] + pieces[3]} == {200}
    budget = length_pieces(lengths, 8, max_tokens=800)  # 4 rows of 200 tokens per piece
    assert [len(p) for p in budget] == [8, 4, 4, 4, 4]


def test_take_pads_the_rows_to_their_own_longest(codec: TextCodec) -> None:
    batch = codec.encode(["a b c d e f g h i j", "a", "a b"], "document")
    part = batch.take([2, 1])
    assert part.input_ids.shape == (2, int(batch.lengths[2]))
    assert part.lengths.tolist() == [batch.lengths[2], batch.lengths[1]]
    assert (part.input_ids[0] == batch.input_ids[2, : part.input_ids.shape[1]]).all()
