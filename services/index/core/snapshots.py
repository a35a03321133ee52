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

:func:`export_state` and :func:`shard_from_state` are the shard's state codec: they read
and set the storage of :class:`~services.index.core.shard.IvfPqShard` (its slots, codes,
tags and drift window) directly, as its own methods would; the shard's write lock is not
needed for the restore (the shard is not shared yet) and the read lock is taken for the
export.
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

import faiss
import numpy as np

from services.common import positions
from services.index.core.pq_drift import PqDrift
from services.index.core.shard import IvfPqShard
from services.index.core.slots import SlotTable
from services.index.core.text import TextConfig, TextIndex
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
    """``data`` at ``path``, mode 0600 (a snapshot holds every vector and text of the
    shard): a temp file written, fsynced and renamed over ``path``."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # a leftover .tmp of a crashed write kept its old mode
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def write_snapshot(shard: IvfPqShard, directory: Path, keep: int = 3) -> Snapshot:
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    directory.chmod(0o700)  # the owner's only, whoever made it and however
    state = export_state(shard)
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
    shard = shard_from_state(trained, state, text)
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


def export_state(shard: IvfPqShard) -> dict[str, np.ndarray]:
    """A consistent copy of everything needed to rebuild this shard (for snapshots):
    refreshed first, writers held out meanwhile (searches go on), so ``applied`` names
    everything the copy holds."""
    with shard.writers():
        return _export_state(shard)


def _export_state(shard: IvfPqShard) -> dict[str, np.ndarray]:
    shard.refresh_held()
    with shard.lock.read():
        fids, slots = shard._slots.items()
        meta = {
            "applied": shard.applied,
            "deleted_total": shard.deleted_total,
            "recent_count": shard._drift.count,
            "recent_sum": shard._drift.total,
            "docs": shard._docs[slots].tolist(),
            "tags": [shard._tags.of(int(f)) for f in fids],
        }
        state = {
            "index": faiss.serialize_index(shard.index),
            "fids": fids,
            "codes": shard._codes[slots].copy(),
        }
        if shard.text is not None:
            # the text index's files at the same position (no apply runs meanwhile)
            files = shard.text.export_files()
            meta["text_files"] = [[name, len(data)] for name, data in files.items()]
            state["text"] = np.frombuffer(b"".join(files.values()), dtype=np.uint8)
        state["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
        return state


def shard_from_state(
    trained: TrainedIndex,
    state: dict[str, np.ndarray],
    text: TextConfig | None = None,
) -> IvfPqShard:
    """The shard :func:`export_state` saved; its text index restored under
    ``text.root`` when the state holds one (else none: the shard serves dense only)."""
    shard = IvfPqShard(trained)
    shard.index = faiss.deserialize_index(np.asarray(state["index"], dtype=np.uint8))
    shard.ivf = faiss.extract_index_ivf(shard.index)
    shard.ivf.set_direct_map_type(faiss.DirectMap.Hashtable)  # type: ignore[attr-defined]
    meta = json.loads(bytes(np.asarray(state["meta"], dtype=np.uint8)).decode())
    fids = np.asarray(state["fids"], dtype=np.int64)
    codes = np.asarray(state["codes"], dtype=np.uint8)
    if len(fids) != int(shard.index.ntotal) or len(codes) != len(fids):
        raise ValueError("snapshot is inconsistent: id count differs from the index")
    capacity = max(1024, 2 * len(fids))
    shard._reserve(capacity)
    shard._codes[: len(fids)] = codes
    shard._docs[: len(fids)] = meta["docs"]
    shard._used = len(fids)
    shard._slots = SlotTable(capacity)
    shard._slots.add(fids, np.arange(len(fids), dtype=np.int64))
    for fid, tags in zip(fids.tolist(), meta["tags"], strict=True):
        shard._tags.add(fid, tags)
    shard.applied = shard.staged = meta["applied"]
    shard.deleted_total = meta["deleted_total"]
    shard._drift = PqDrift(meta["recent_count"], meta["recent_sum"])
    if text is not None and "text" in state:
        blob = bytes(np.asarray(state["text"], dtype=np.uint8))
        files, at = {}, 0
        for name, size in meta["text_files"]:
            files[name] = blob[at : at + size]
            at += size
        if at != len(blob):
            raise ValueError("snapshot is inconsistent: text index files differ in size")
        shard.text = TextIndex.restore(text.root, files, text.language)
    elif text is not None:
        log.warning(
            "snapshot at %s has no text index: this replica serves dense searches only",
            shard.applied,
        )
    return shard
