"""The changes a shard applies, as they come out of its log."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Upsert:
    doc_id: str
    vector: np.ndarray  # float32 (dim,)
    tags: dict[str, str] = field(default_factory=dict)
    version: int = 0
    body: str = ""  # title + " " + text, what the text (BM25) index indexes


@dataclass(frozen=True)
class Delete:
    doc_id: str
    version: int = 0


Change = Upsert | Delete


def body_of(title: str, text: str) -> str:
    """What the text index indexes of a document (:attr:`Upsert.body`). Here, not in the text
    index's module, because the change-log writer builds it in the gateway, which never
    loads tantivy."""
    return f"{title} {text}" if title else text
