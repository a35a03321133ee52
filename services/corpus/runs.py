"""Ranked-list files: ``{query id: [doc id, ...]}`` (best first) of any first stage.

``gtr-retrieval tune`` writes its first stages' runs in this form and hands them to the
encoder and reranker trainers, which mine hard negatives from them.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from pathlib import Path

from services.common.errors import InvalidArgument


def read_run(path: Path, qids: Sequence[str], known: Collection[str]) -> dict[str, list[str]]:
    """The lists of ``qids`` from the file, documents not in ``known`` dropped;
    InvalidArgument when the file is unreadable or lacks one of ``qids``."""
    try:
        run = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"{path}: not a readable JSON run ({exc})") from exc
    if not isinstance(run, dict) or not all(isinstance(v, list) for v in run.values()):
        raise InvalidArgument(f"{path}: expected {{query id: [doc id, ...]}}")
    missing = [q for q in qids if q not in run]
    if missing:
        raise InvalidArgument(f"{path}: no list for {len(missing)} queries (e.g. {missing[0]})")
    return {q: [d for d in run[q] if d in known] for q in qids}
