"""Corpus readers and the embedded stdlib corpus."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.corpus.readers import CorpusFormatError, count_lines, read_corpus
from services.corpus.stdlib import collect_in_subprocess


def test_beir_and_plain_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text(
        '{"_id": "1", "title": "T", "text": "body", "source": "x"}\n'
        "\n"
        '{"id": 2, "text": "plain", "metadata": {"lang": "en", "n": 3}}\n',
        encoding="utf-8",
    )
    docs = list(read_corpus(path))
    assert [d.id for d in docs] == ["1", "2"]
    assert docs[0].title == "T" and docs[0].metadata == {"source": "x"}
    assert docs[1].metadata == {"lang": "en", "n": "3"}
    assert count_lines(path) == 2
    assert len(list(read_corpus(path, limit=1))) == 1


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("not json", "c.jsonl:1: not JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"text": "x"}', "missing string '_id' or 'id'"),
        ('{"_id": "a"}', "missing string 'text'"),
        ('{"_id": "a", "text": "x", "title": 3}', "'title' must be a string"),
    ],
)
def test_bad_lines_name_the_line(tmp_path: Path, line: str, needle: str) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text(line + "\n", encoding="utf-8")
    with pytest.raises(CorpusFormatError, match=None) as err:
        list(read_corpus(path))
    assert needle in str(err.value)


def test_stdlib_corpus_has_the_documented_library() -> None:
    docs = collect_in_subprocess()
    by_id = {d.id: d for d in docs}
    assert len(docs) > 2000
    assert len(by_id) == len(docs), "ids are unique"
    # functions of a public module implemented in a private one are documented publicly
    assert "csv.reader" in by_id and "CSV" in by_id["csv.reader"].text.upper()
    assert by_id["json.loads"].title == "json.loads"
    assert by_id["json.loads"].text.startswith("loads(")
    assert {"module", "class", "function", "method"} <= {d.kind for d in docs}
    assert not any(d.id.startswith(("tkinter", "idlelib", "test.")) for d in docs)
