"""A replica that cannot replay its log seeds itself from a ready peer of its shard.

When a replica starts with no usable snapshot (a new pod of a scaled-up StatefulSet, a
lost volume) and its shard's log was trimmed past its position, replaying the log would
silently miss changes. It then asks its peers (``--peers``: a list of ``host:port``, or
one ``dns:///name:port`` target, the chart's headless Service of the shard, resolved
now) for their newest snapshot (``IndexShardService.FetchSnapshot``): the first peer
that serves sends it as checksummed chunks (:mod:`services.index.core.transfer` verifies
and installs them); the replica then loads it and replays the log from its position.
A peer that is down, not serving yet, of another shard or index generation, or that
sends a file that does not match its checksum is passed over for the next one; rounds
repeat (peers of a StatefulSet start together) until ``seed_timeout_s``, then the start
fails with FailedPrecondition. The replica itself is not serving during all this, so it never
answers its own request.

A replica without its trained index (``manifest.json`` in ``--index-dir``) asks for it
in the same transfer (``with_index``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from retrieval.v1 import index_pb2, index_pb2_grpc
from services.common.errors import FailedPrecondition, RetrievalError, Unavailable
from services.index import convert
from services.index.core.snapshots import Snapshot
from services.index.core.transfer import Receiver, TransferError
from services.index.server.settings import ShardSettings
from services.rpc.discovery import is_dns_target, parse_dns_target, resolve
from services.rpc.status import error_from_rpc
from services.rpc.tls import ClientTLS, aio_channel

log = logging.getLogger(__name__)

RETRY_EVERY_S = 2.0
MAX_MESSAGE_BYTES = 8 << 20  # a 1 MiB chunk and its framing, with room


@dataclass(frozen=True)
class Seeded:
    snapshot: Snapshot
    peer: str
    bytes: int
    seconds: float


async def peer_addresses(spec: str) -> list[str]:
    """The peers of ``spec``: its ``host:port`` list, or what its dns: target resolves to."""
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if len(parts) == 1 and is_dns_target(parts[0]):
        return await resolve(parse_dns_target(parts[0]))
    return parts


def peer_tls(settings: ShardSettings) -> ClientTLS | None:
    """TLS to the peers (``--tls-ca`` …); peers found by a DNS name are IP addresses, so
    their certificates are checked against that name."""
    tls = settings.client_tls()
    spec = (settings.peers or "").strip()
    if tls is not None and tls.server_name is None and is_dns_target(spec):
        tls = dataclasses.replace(tls, server_name=parse_dns_target(spec).host)
    return tls


async def fetch_from(address: str, settings: ShardSettings, with_index: bool) -> Seeded:
    """The newest snapshot of the peer at ``address``, verified and installed."""
    started = time.monotonic()
    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
    async with aio_channel(address, peer_tls(settings), options) as channel:
        stub = index_pb2_grpc.IndexShardServiceStub(channel)
        call = stub.FetchSnapshot(
            index_pb2.FetchSnapshotRequest(
                shard=settings.shard,
                replica=settings.replica,
                with_index=with_index,
                generation=settings.generation,
            ),
            timeout=settings.seed_timeout_s,
        )
        receiver: Receiver | None = None
        try:
            async for chunk in call:
                if receiver is None:
                    receiver = Receiver(
                        Path(settings.snapshot_dir),
                        Path(settings.index_dir),
                        chunk.position,
                        convert.files_from_pb(chunk),
                    )
                    continue
                receiver.write(chunk.file, chunk.offset, chunk.data)
            if receiver is None:
                raise TransferError(f"{address} sent no snapshot")
            snapshot = receiver.finish()
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc, f"peer {address}") from exc
        finally:
            if receiver is not None:
                receiver.abort()
    return Seeded(snapshot, address, receiver.received_bytes, time.monotonic() - started)


async def seed_from_peers(settings: ShardSettings, with_index: bool = False) -> Seeded:
    """Fetch the newest snapshot of the first peer that gives one; FailedPrecondition
    when none did within ``seed_timeout_s``."""
    if not settings.peers:
        raise FailedPrecondition("no --peers to seed from")
    deadline = time.monotonic() + settings.seed_timeout_s
    why: list[str] = []
    while True:
        why = []
        try:
            peers = await peer_addresses(settings.peers)
        except Unavailable as exc:
            peers, why = [], [str(exc)]
        for peer in peers:
            try:
                seeded = await fetch_from(peer, settings, with_index)
            except (RetrievalError, TransferError, ValueError, OSError) as exc:
                log.warning("no snapshot from peer %s: %s", peer, exc)
                why.append(f"{peer}: {exc}")
                continue
            log.info(
                "seeded shard %d from peer %s: snapshot at %s, %d bytes in %.1f s",
                settings.shard,
                peer,
                seeded.snapshot.position,
                seeded.bytes,
                seeded.seconds,
            )
            return seeded
        if time.monotonic() + RETRY_EVERY_S > deadline:
            raise FailedPrecondition(
                f"shard {settings.shard}: no peer of {settings.peers} gave a snapshot within "
                f"{settings.seed_timeout_s:g} s ({'; '.join(why) or 'no peer found'})"
            )
        await asyncio.sleep(RETRY_EVERY_S)
