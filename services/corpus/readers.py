"""Read a corpus file into documents: BEIR ``corpus.jsonl`` or plain JSONL.

Accepted per line: ``{"_id" | "id": str, "title"?: str, "text": str, "metadata"?: {str: str}}``
(BEIR puts extra fields at top level; those that are strings become metadata). Each
line becomes the service's own :class:`~services.common.domain.Document` (version 0: not
stored yet), the type the gateway stores and the local stack encodes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from services.common.domain import Document


class CorpusFormatError(ValueError):
    """A line of the corpus file is not a document; the message names the line."""


_KNOWN = {"_id", "id", "title", "text", "metadata"}


def parse_line(line: str, where: str) -> Document:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise CorpusFormatError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(row, dict):
        raise CorpusFormatError(f"{where}: expected a JSON object")
    doc_id = row.get("_id", row.get("id"))
    if isinstance(doc_id, int):
        doc_id = str(doc_id)
    if not isinstance(doc_id, str) or not doc_id:
        raise CorpusFormatError(f"{where}: missing string '_id' or 'id'")
    text = row.get("text")
    if not isinstance(text, str):
        raise CorpusFormatError(f"{where}: missing string 'text'")
    title = row.get("title") or ""
    if not isinstance(title, str):
        raise CorpusFormatError(f"{where}: 'title' must be a string")
    metadata: dict[str, str] = {}
    raw_meta = row.get("metadata") or {}
    if isinstance(raw_meta, dict):
        metadata.update({str(k): str(v) for k, v in raw_meta.items() if isinstance(v, str | int)})
    for key, value in row.items():
        if key not in _KNOWN and isinstance(value, str):
            metadata[key] = value
    return Document(id=doc_id, text=text, title=title, metadata=metadata)


def read_corpus(path: Path | str, limit: int | None = None) -> Iterator[Document]:
    """Yield the documents of a JSONL corpus file, in file order (blank lines skipped)."""
    path = Path(path)
    with path.open(encoding="utf-8") as fh:
        count = 0
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            yield parse_line(line, f"{path.name}:{lineno}")
            count += 1
            if limit is not None and count >= limit:
                return


def count_lines(path: Path | str) -> int:
    with Path(path).open("rb") as fh:
        return sum(1 for line in fh if line.strip())
