"""``up`` prints example searches that fit the corpus it ingested (issue #14, found
trying the README): the stdlib queries only for the stdlib corpus."""

from __future__ import annotations

import json
from pathlib import Path

from services.stack.config import STDLIB_EXAMPLES, StackConfig, example_queries


def test_the_default_corpus_gets_the_stdlib_examples() -> None:
    assert example_queries(StackConfig()) == STDLIB_EXAMPLES


def test_a_beir_folder_gives_its_own_queries(tmp_path: Path) -> None:
    (tmp_path / "corpus.jsonl").write_text('{"_id": "1", "text": "a document"}\n')
    rows = [{"_id": str(i), "text": f"question {i}"} for i in range(5)]
    (tmp_path / "queries.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    got = example_queries(StackConfig(corpus=tmp_path / "corpus.jsonl"))
    assert got == ("question 0", "question 1", "question 2")


def test_a_corpus_without_queries_gets_none(tmp_path: Path) -> None:
    (tmp_path / "docs.jsonl").write_text('{"_id": "1", "text": "a document"}\n')
    assert example_queries(StackConfig(corpus=tmp_path / "docs.jsonl")) == ()


def test_broken_lines_of_the_queries_file_are_passed_over(tmp_path: Path) -> None:
    (tmp_path / "corpus.jsonl").write_text('{"_id": "1", "text": "a document"}\n')
    (tmp_path / "queries.jsonl").write_text('{"_id": "1", "text": "ok"}\nnot json\n[1, 2]\n')
    assert example_queries(StackConfig(corpus=tmp_path / "corpus.jsonl")) == ("ok",)
