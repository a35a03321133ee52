"""A replica's snapshot (and trained index) sent to a peer as files in checksummed chunks.

The sending side (:func:`open_offer`) opens the newest snapshot's two files (the npz and
its manifest) and, when asked, the trained index's, hashes each one through its open
handle and then reads it again in chunks of :data:`CHUNK_BYTES`: a snapshot pruned by
the sender's own snapshot thread meanwhile stays readable (the handle keeps it).

The receiving side (:class:`Receiver`) writes each file into a staging directory beside
its destination, in order, checks each file's size and sha256 against the list it was
announced with, and the snapshot's own manifest against the npz (its sha256, size and
log position); only then are the files fsynced and renamed into place (index files
first, the snapshot's npz before its manifest), and the directories fsynced. A transfer
that fails half-way leaves nothing but its staging directory, which is removed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from services.common import positions
from services.index.core.snapshots import Snapshot, fsync_dir, list_snapshots
from services.index.core.trained import MANIFEST, REFINE, TRAINED

CHUNK_BYTES = 1 << 20
INDEX_FILES = (MANIFEST, TRAINED, REFINE)
STAGING_PREFIX = ".incoming-"


class TransferError(Exception):
    """The files received do not match what was announced (size, checksum, manifest)."""


@dataclass(frozen=True)
class FileInfo:
    name: str
    size: int
    sha256: str
    index: bool = False  # a file of the trained index (else of the snapshot)


@dataclass
class Offer:
    """What a sender streams: the snapshot's position and its files, opened."""

    position: str
    files: list[FileInfo]
    handles: list[BinaryIO] = field(repr=False)

    def chunks(self) -> Iterator[tuple[int, int, bytes]]:
        """``(file index, offset, data)`` in order, at most CHUNK_BYTES each."""
        for i, handle in enumerate(self.handles):
            handle.seek(0)
            offset = 0
            while data := handle.read(CHUNK_BYTES):
                yield i, offset, data
                offset += len(data)

    def close(self) -> None:
        for handle in self.handles:
            handle.close()


def _hash(handle: BinaryIO) -> tuple[int, str]:
    digest = hashlib.sha256()
    size = 0
    while data := handle.read(CHUNK_BYTES):
        digest.update(data)
        size += len(data)
    return size, digest.hexdigest()


def open_offer(snapshot: Snapshot, index_dir: Path | None = None) -> Offer:
    """Open ``snapshot``'s files (and the trained index in ``index_dir`` when given)."""
    paths: list[tuple[Path, bool]] = []
    if index_dir is not None:
        paths += [(index_dir / name, True) for name in INDEX_FILES]
    paths += [(snapshot.path, False), (snapshot.path.with_suffix(".json"), False)]
    handles: list[BinaryIO] = []
    files: list[FileInfo] = []
    try:
        for path, index in paths:
            handle: BinaryIO = open(path, "rb")  # noqa: SIM115 (closed by Offer.close)
            handles.append(handle)
            size, sha = _hash(handle)
            files.append(FileInfo(path.name, size, sha, index))
    except BaseException:
        for opened in handles:
            opened.close()
        raise
    return Offer(snapshot.position, files, handles)


def newest_snapshot(directory: Path) -> Snapshot | None:
    """The newest snapshot whose manifest exists (its checksum is the receiver's check)."""
    for snapshot in list_snapshots(directory):
        if snapshot.path.with_suffix(".json").exists():
            return snapshot
    return None


class Receiver:
    """``Receiver(snapshot_dir, index_dir, position, files)``; ``write`` each chunk in order;
    ``finish()`` → the installed Snapshot. ``abort()`` removes what was staged."""

    def __init__(
        self, snapshot_dir: Path, index_dir: Path, position: str, files: Sequence[FileInfo]
    ) -> None:
        positions.parse(position)
        for f in files:
            if os.path.basename(f.name) != f.name or f.name.startswith("."):
                raise TransferError(f"{f.name!r} is not a plain file name")
            if f.index and f.name not in INDEX_FILES:
                raise TransferError(f"{f.name!r} is not a file of a trained index")
        snapshots = [f for f in files if not f.index]
        npz = [f for f in snapshots if f.name.endswith(".npz")]
        if len(npz) != 1 or len(snapshots) != 2:
            raise TransferError(f"expected one snapshot (npz + manifest), got {snapshots}")
        self.position = position
        self.files = list(files)
        self.npz = npz[0]
        token = f"{STAGING_PREFIX}{os.getpid()}-{time.monotonic_ns()}"
        self._dest = {False: snapshot_dir, True: index_dir}
        self._staging = {False: snapshot_dir / token, True: index_dir / token}
        self._written = [0] * len(files)
        self._digests = [hashlib.sha256() for _ in files]
        self._open: tuple[int, BinaryIO] | None = None
        self._current = 0
        for index in {f.index for f in files}:
            self._dest[index].mkdir(parents=True, exist_ok=True, mode=0o700)
            self._staging[index].mkdir(mode=0o700)

    @property
    def received_bytes(self) -> int:
        return sum(self._written)

    def _path(self, i: int) -> Path:
        f = self.files[i]
        return self._staging[f.index] / f.name

    def write(self, i: int, offset: int, data: bytes) -> None:
        if not 0 <= i < len(self.files) or i < self._current:
            raise TransferError(f"chunk of file {i} out of order (at file {self._current})")
        if offset != self._written[i]:
            raise TransferError(
                f"{self.files[i].name}: chunk at {offset}, expected {self._written[i]}"
            )
        if self._written[i] + len(data) > self.files[i].size:
            raise TransferError(f"{self.files[i].name}: more bytes than announced")
        if self._open is None or self._open[0] != i:
            self._close_current()
            self._current = i
            # the owner's only (0600): a seeded snapshot holds every vector and text
            fd = os.open(self._path(i), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            self._open = (i, os.fdopen(fd, "wb"))
        self._open[1].write(data)
        self._digests[i].update(data)
        self._written[i] += len(data)

    def _close_current(self) -> None:
        if self._open is not None:
            handle = self._open[1]
            handle.flush()
            os.fsync(handle.fileno())
            handle.close()
            self._open = None

    def finish(self) -> Snapshot:
        self._close_current()
        for i, f in enumerate(self.files):
            if not self._path(i).exists():  # an empty file gets no chunk
                self._path(i).touch()
            if self._written[i] != f.size or self._digests[i].hexdigest() != f.sha256:
                raise TransferError(
                    f"{f.name}: received {self._written[i]} bytes with sha256 "
                    f"{self._digests[i].hexdigest()}, announced {f.size} bytes {f.sha256}"
                )
        manifest_file = next(f for f in self.files if not f.index and f is not self.npz)
        try:
            manifest = json.loads(
                (self._staging[False] / manifest_file.name).read_text(encoding="utf-8")
            )
        except ValueError as exc:
            raise TransferError(f"{manifest_file.name}: not a snapshot manifest ({exc})") from exc
        if manifest.get("sha256") != self.npz.sha256 or manifest.get("bytes") != self.npz.size:
            raise TransferError(f"{manifest_file.name} does not describe {self.npz.name}")
        if manifest.get("position") != self.position or manifest_file.name != (
            Path(self.npz.name).with_suffix(".json").name
        ):
            raise TransferError(f"{manifest_file.name}: not the snapshot at {self.position}")
        # index files first, then the npz, its manifest last: a crash in between leaves
        # a snapshot without manifest, which loading skips
        order = [f for f in self.files if f.index] + [self.npz, manifest_file]
        for f in order:
            os.replace(self._staging[f.index] / f.name, self._dest[f.index] / f.name)
        for index in {f.index for f in self.files}:
            fsync_dir(self._dest[index])
        self.abort()
        return Snapshot(self._dest[False] / self.npz.name, self.position)

    def abort(self) -> None:
        if self._open is not None:
            self._open[1].close()
            self._open = None
        for staging in self._staging.values():
            shutil.rmtree(staging, ignore_errors=True)
