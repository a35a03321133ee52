"""A snapshot sent to a peer in chunks: what arrives is installed only when it is exactly
what was announced (services/index/core/transfer.py)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from retrieval.v1 import index_pb2
from services.index import convert
from services.index.core.snapshots import Snapshot
from services.index.core.trained import MANIFEST, REFINE, TRAINED
from services.index.core.transfer import (
    CHUNK_BYTES,
    FileInfo,
    Receiver,
    TransferError,
    newest_snapshot,
    open_offer,
)

POSITION = "1700000000000-3"


def _snapshot(directory: Path, size: int = 2 * CHUNK_BYTES + 123) -> Snapshot:
    """A snapshot's two files (the npz is opaque bytes here: the transfer never parses
    it; loading it is the replica's, after the transfer checked it)."""
    directory.mkdir(parents=True, exist_ok=True)
    data = os.urandom(size)
    npz = directory / f"snap-{POSITION}.npz"
    npz.write_bytes(data)
    manifest = {"position": POSITION, "sha256": hashlib.sha256(data).hexdigest(), "bytes": size}
    npz.with_suffix(".json").write_text(json.dumps(manifest))
    return Snapshot(npz, POSITION)


def _index(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name in (MANIFEST, TRAINED, REFINE):
        (directory / name).write_bytes(os.urandom(5000))
    return directory


def _send(sender: Path, receiver: Receiver, corrupt_at: int | None = None) -> None:
    snapshot = newest_snapshot(sender / "snaps")
    assert snapshot is not None
    offer = open_offer(snapshot, sender / "index" if (sender / "index").exists() else None)
    try:
        for n, (i, offset, data) in enumerate(offer.chunks()):
            if n == corrupt_at:
                data = bytes([data[0] ^ 1]) + data[1:]
            receiver.write(i, offset, data)
    finally:
        offer.close()


def _receiver(sender: Path, dest: Path) -> Receiver:
    snapshot = newest_snapshot(sender / "snaps")
    assert snapshot is not None
    offer = open_offer(snapshot, sender / "index" if (sender / "index").exists() else None)
    offer.close()
    return Receiver(dest / "snaps", dest / "index", offer.position, offer.files)


def test_a_snapshot_and_its_trained_index_arrive_identical(tmp_path: Path) -> None:
    sent = _snapshot(tmp_path / "a" / "snaps")
    _index(tmp_path / "a" / "index")
    receiver = _receiver(tmp_path / "a", tmp_path / "b")
    _send(tmp_path / "a", receiver)
    got = receiver.finish()
    assert got.position == POSITION
    assert got.path.read_bytes() == sent.path.read_bytes()
    assert got.path.with_suffix(".json").read_bytes() == sent.path.with_suffix(".json").read_bytes()
    for name in (MANIFEST, TRAINED, REFINE):
        assert (tmp_path / "b" / "index" / name).read_bytes() == (
            tmp_path / "a" / "index" / name
        ).read_bytes()
    leftovers = [p.name for p in (tmp_path / "b").rglob(".incoming-*")]
    assert leftovers == []


@pytest.mark.parametrize("size", [0, 1, CHUNK_BYTES, 2 * CHUNK_BYTES + 123])
def test_a_snapshot_sent_as_wire_messages_arrives_identical(tmp_path: Path, size: int) -> None:
    """The transfer as FetchSnapshot carries it: the offer (convert.offer_to_pb) and each
    chunk as a SnapshotChunk, serialised and parsed, read as seeding reads them."""
    sent = _snapshot(tmp_path / "a" / "snaps", size)
    _index(tmp_path / "a" / "index")
    offer = open_offer(sent, tmp_path / "a" / "index")
    try:
        wire = [convert.offer_to_pb(offer).SerializeToString()] + [
            index_pb2.SnapshotChunk(file=i, offset=offset, data=data).SerializeToString()
            for i, offset, data in offer.chunks()
        ]
    finally:
        offer.close()
    first, *rest = (index_pb2.SnapshotChunk.FromString(m) for m in wire)
    receiver = Receiver(
        tmp_path / "b" / "snaps",
        tmp_path / "b" / "index",
        first.position,
        convert.files_from_pb(first),
    )
    for chunk in rest:
        receiver.write(chunk.file, chunk.offset, chunk.data)
    got = receiver.finish()
    assert got.position == POSITION and got.path.read_bytes() == sent.path.read_bytes()
    for name in (MANIFEST, TRAINED, REFINE):
        assert (tmp_path / "b" / "index" / name).read_bytes() == (
            tmp_path / "a" / "index" / name
        ).read_bytes()


@pytest.mark.parametrize("chunk", [0, 2])  # the first and the last chunk of the npz
def test_a_corrupted_chunk_installs_nothing(tmp_path: Path, chunk: int) -> None:
    _snapshot(tmp_path / "a" / "snaps")
    receiver = _receiver(tmp_path / "a", tmp_path / "b")
    _send(tmp_path / "a", receiver, corrupt_at=chunk)
    with pytest.raises(TransferError, match="sha256"):
        receiver.finish()
    receiver.abort()
    assert list((tmp_path / "b" / "snaps").iterdir()) == []


def test_a_manifest_that_does_not_describe_the_npz_is_refused(tmp_path: Path) -> None:
    sent = _snapshot(tmp_path / "a" / "snaps")
    manifest = json.loads(sent.path.with_suffix(".json").read_text())
    manifest["sha256"] = "0" * 64
    sent.path.with_suffix(".json").write_text(json.dumps(manifest))
    receiver = _receiver(tmp_path / "a", tmp_path / "b")
    _send(tmp_path / "a", receiver)
    with pytest.raises(TransferError, match="does not describe"):
        receiver.finish()
    receiver.abort()
    assert list((tmp_path / "b" / "snaps").iterdir()) == []


def test_a_short_transfer_is_refused(tmp_path: Path) -> None:
    _snapshot(tmp_path / "a" / "snaps")
    receiver = _receiver(tmp_path / "a", tmp_path / "b")
    receiver.write(0, 0, b"x" * 10)
    with pytest.raises(TransferError, match="received 10 bytes"):
        receiver.finish()
    receiver.abort()


def test_chunks_out_of_order_are_refused(tmp_path: Path) -> None:
    _snapshot(tmp_path / "a" / "snaps")
    receiver = _receiver(tmp_path / "a", tmp_path / "b")
    with pytest.raises(TransferError, match="expected 0"):
        receiver.write(0, 5, b"abc")
    receiver.abort()


@pytest.mark.parametrize("name", ["../snap-1-0.npz", "/tmp/snap-1-0.npz", ".snap-1-0.npz"])
def test_file_names_that_leave_the_directory_are_refused(tmp_path: Path, name: str) -> None:
    files = [FileInfo(name, 1, "0" * 64), FileInfo(f"snap-{POSITION}.json", 1, "0" * 64)]
    with pytest.raises(TransferError, match="not a plain file name"):
        Receiver(tmp_path / "s", tmp_path / "i", POSITION, files)
    assert not (tmp_path / "s").exists()
