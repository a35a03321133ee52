"""A replica's snapshot folder belongs to one index generation: the positions of its
snapshots are that generation's log's."""

from __future__ import annotations

from pathlib import Path

from services.common.errors import FailedPrecondition
from services.index.core.snapshots import list_snapshots
from services.index.keys import FIRST_GENERATION

GENERATION_FILE = "GENERATION"  # in a snapshot folder: the generation its snapshots follow


def claim_snapshot_folder(directory: Path, generation: str) -> None:
    """Record in ``directory`` the index generation its snapshots follow; FailedPrecondition
    when it holds another generation's: their positions are another log's, so a replay
    from them would skip or misapply changes. A folder with snapshots and no
    :data:`GENERATION_FILE` was written before generations existed: g1's."""
    marker = directory / GENERATION_FILE
    if marker.is_file():
        found: str | None = marker.read_text().strip()
    else:
        found = FIRST_GENERATION if list_snapshots(directory) else None
    if found is not None and found != generation:
        raise FailedPrecondition(
            f"{directory} holds snapshots of generation {found}, this replica serves "
            f"generation {generation}: give it a snapshot folder of its own"
        )
    if not marker.is_file():
        directory.mkdir(parents=True, exist_ok=True)
        marker.write_text(generation + "\n")
