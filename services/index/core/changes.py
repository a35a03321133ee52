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
