"""Snapshots of a shard: durable files that record the last applied log position.

A snapshot is one file ``snap-<ms>-<seq>.npz`` (uncompressed npz: the serialized FAISS
index — ``faiss.serialize_index``, the bytes ``faiss.write_index`` writes — the SQ8
codes, the id map, doc ids, tags, the applied position, and the files of the shard's
Tantivy text index at that same position) plus its manifest
``snap-<ms>-<seq>.json``: position, sha256 and size of the npz, vectors, factory,
creation time. It is written to a temp file, fsynced, renamed, and the
directory fsynced, so a crash leaves either the old set or the new one. On start the
newest snapshot whose checksum matches and which loads is used; a corrupt or truncated
one is logged and skipped. The newest ``keep`` snapshots are kept.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.common import positions
from services.index.core.shard import IvfPqShard, TextConfig
from services.index.core.text import TextIndex
from services.index.core.trained import TrainedIndex

log = logging.getLogger(__name__)

PREFIX = "snap-"
SUFFIX = ".npz"


@dataclass(frozen=True)
class Snapshot:
    path: Path
    position: str


def fsync_dir(directory: Path) -> None:
    """Make the entries of ``directory`` (a file renamed or created in it) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def write_snapshot(shard: IvfPqShard, directory: Path, keep: int = 3) -> Snapshot:
    directory.mkdir(parents=True, exist_ok=True)
    state = shard.export_state()
    position = json.loads(bytes(state["meta"]))["applied"]
    buffer = io.BytesIO()
    np.savez(buffer, **state)
    data = buffer.getvalue()
    path = directory / f"{PREFIX}{position}{SUFFIX}"
    manifest = {
        "position": position,
        "sha256": hashlib.sha256(data).hexdigest(),
        "bytes": len(data),
        "vectors": len(state["fids"]),
        "text_index_bytes": int(state["text"].size) if "text" in state else None,
        "factory": shard.manifest.factory,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    _write_durably(path, data)
    _write_durably(path.with_suffix(".json"), json.dumps(manifest, indent=2).encode())
    fsync_dir(directory)
    prune(directory, keep)
    return Snapshot(path, position)


def list_snapshots(directory: Path) -> list[Snapshot]:
    """Snapshots in ``directory``, newest first."""
    if not directory.exists():
        return []
    found = []
    for path in directory.glob(f"{PREFIX}*{SUFFIX}"):
        position = path.name[len(PREFIX) : -len(SUFFIX)]
        try:
            positions.parse(position)
        except Exception:
            continue
        found.append(Snapshot(path, position))
    return sorted(found, key=lambda s: positions.parse(s.position), reverse=True)


def prune(directory: Path, keep: int) -> None:
    for old in list_snapshots(directory)[keep:]:
        old.path.unlink(missing_ok=True)
        old.path.with_suffix(".json").unlink(missing_ok=True)


def load_snapshot(
    snapshot: Snapshot, trained: TrainedIndex, text: TextConfig | None = None
) -> IvfPqShard:
    data = snapshot.path.read_bytes()
    manifest = json.loads(snapshot.path.with_suffix(".json").read_text())
    if len(data) != manifest["bytes"] or hashlib.sha256(data).hexdigest() != manifest["sha256"]:
        raise ValueError(f"{snapshot.path.name}: checksum mismatch (corrupt or truncated)")
    with np.load(io.BytesIO(data)) as arrays:
        state = {name: arrays[name] for name in arrays.files}
    shard = IvfPqShard.from_state(trained, state, text)
    if shard.applied != snapshot.position:
        raise ValueError(f"{snapshot.path.name}: records position {shard.applied}")
    return shard


def load_newest(
    directory: Path, trained: TrainedIndex, text: TextConfig | None = None
) -> tuple[IvfPqShard, Snapshot | None]:
    """The newest valid snapshot, or an empty shard from the trained index (with an
    empty text index when ``text`` is given)."""
    for snapshot in list_snapshots(directory):
        try:
            return load_snapshot(snapshot, trained, text), snapshot
        except Exception as exc:
            log.error("snapshot %s unusable (%s); trying an older one", snapshot.path, exc)
    empty = TextIndex.create(text.root, text.language) if text is not None else None
    return IvfPqShard(trained, empty), None
