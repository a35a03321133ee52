"""A replica of one shard: the in-memory shard kept in step with its Redis Stream.

Start: newest valid snapshot (or the trained, empty index) → register the replica's
snapshot position in ``snap:{shard}`` (so the log is never trimmed past it) → replay the
stream from that position → ready. Then a consumer thread XREADs new entries and applies
them in batches; every ``snapshot_every_entries`` applied changes or
``snapshot_every_s`` seconds it writes a snapshot and trims the log below the oldest
snapshot position of all replicas of the shard.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import redis
import redis.asyncio as aioredis

from services.common.errors import DeadlineExceeded, Unavailable
from services.index import positions
from services.index.changelog import SNAPSHOT_POSITIONS, decode_entry, log_key
from services.index.changes import Change
from services.index.metrics import ShardMetrics
from services.index.snapshots import Snapshot, load_newest, write_snapshot
from services.index.train import TrainedIndex

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaConfig:
    shard: int
    num_shards: int
    replica: str
    redis_url: str
    index_dir: Path
    snapshot_dir: Path
    snapshot_every_entries: int = 20_000
    snapshot_every_s: float = 60.0
    keep_snapshots: int = 3
    read_count: int = 512  # stream entries per XREAD
    block_ms: int = 50


class ShardReplica:
    def __init__(self, config: ReplicaConfig, metrics: ShardMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self.trained = TrainedIndex.load(config.index_dir)
        self.shard, snapshot = load_newest(config.snapshot_dir, self.trained)
        self.snapshot_position = snapshot.position if snapshot else positions.ZERO
        self.log_lag_s = 0.0
        self.ready = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiters: list[tuple[str, asyncio.Future[None]]] = []
        self._since_snapshot = 0
        self._last_snapshot = time.monotonic()
        self._sync = redis.Redis.from_url(config.redis_url, socket_timeout=10.0)
        self._async = aioredis.Redis.from_url(config.redis_url, socket_timeout=5.0)
        if metrics is not None:
            metrics.bind(self.shard)

    @property
    def key(self) -> str:
        return log_key(self.config.shard)

    # --- lifecycle -------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._register(self.snapshot_position)
        self._thread = threading.Thread(target=self._consume, name="log-consumer", daemon=True)
        self._thread.start()

    def stop(self, snapshot: bool = True) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        if snapshot and self.ready.is_set():
            self.snapshot()

    async def close(self) -> None:
        await self._async.aclose()
        self._sync.close()

    # --- the consumer thread -----------------------------------------------------------

    def _consume(self) -> None:
        try:
            tail = self._tail_sync()
            if positions.at_least(self.shard.applied, tail):
                self.ready.set()
            while not self._stop.is_set():
                try:
                    reply = self._sync.xread(
                        {self.key: self.shard.applied},
                        count=self.config.read_count,
                        block=self.config.block_ms,
                    )
                except redis.RedisError as exc:
                    log.warning("reading %s failed (%s); retrying", self.key, exc)
                    self._stop.wait(0.5)
                    continue
                entries = reply[0][1] if reply else []
                if entries:
                    self._apply(entries)
                else:
                    self.log_lag_s = 0.0
                if not self.ready.is_set() and positions.at_least(self.shard.applied, tail):
                    log.info("shard %d replayed to %s", self.config.shard, self.shard.applied)
                    self.ready.set()
                self._maybe_snapshot()
        except Exception:
            log.exception("log consumer of shard %d stopped", self.config.shard)
            raise

    def _apply(self, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
        changes: list[Change] = []
        for _entry_id, fields in entries:
            changes.extend(decode_entry(fields))
        last = entries[-1][0].decode()
        self.shard.apply(changes, last)
        self._since_snapshot += len(changes)
        behind = len(entries) == self.config.read_count
        self.log_lag_s = max(0.0, time.time() - positions.ms_of(last) / 1000.0) if behind else 0.0
        if self.metrics is not None:
            self.metrics.applied_vectors.labels(*self.metrics.labels).inc(len(changes))
            self.metrics.log_lag.labels(*self.metrics.labels).set(self.log_lag_s)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake_waiters)

    def _maybe_snapshot(self) -> None:
        due_entries = self._since_snapshot >= self.config.snapshot_every_entries
        due_time = (
            self._since_snapshot > 0
            and time.monotonic() - self._last_snapshot >= self.config.snapshot_every_s
        )
        if due_entries or due_time:
            self.snapshot()

    def snapshot(self) -> Snapshot:
        snap = write_snapshot(self.shard, self.config.snapshot_dir, self.config.keep_snapshots)
        self.snapshot_position = snap.position
        self._since_snapshot = 0
        self._last_snapshot = time.monotonic()
        try:
            self._register(snap.position)
            self._trim()
        except redis.RedisError as exc:
            log.warning("could not record snapshot position / trim (%s)", exc)
        return snap

    def _register(self, position: str) -> None:
        self._sync.hset(f"{SNAPSHOT_POSITIONS}{self.config.shard}", self.config.replica, position)

    def _trim(self) -> None:
        """Trim the log below the oldest snapshot position of every registered replica."""
        known = self._sync.hvals(f"{SNAPSHOT_POSITIONS}{self.config.shard}")
        if not known:
            return
        floor = positions.oldest(*[p.decode() for p in known])
        if floor != positions.ZERO:
            self._sync.xtrim(self.key, minid=floor, approximate=False)

    def _tail_sync(self) -> str:
        reply = self._sync.xrevrange(self.key, count=1)
        return reply[0][0].decode() if reply else positions.ZERO

    # --- waiting for positions (event loop side) -----------------------------------------

    def _wake_waiters(self) -> None:
        still = []
        for wanted, future in self._waiters:
            if future.done():
                continue
            if positions.at_least(self.shard.applied, wanted):
                future.set_result(None)
            else:
                still.append((wanted, future))
        self._waiters = still

    async def wait_for(self, wanted: str, timeout: float | None) -> None:
        """Return once ``wanted`` is applied; DeadlineExceeded when ``timeout`` runs out."""
        if positions.at_least(self.shard.applied, wanted):
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((wanted, future))
        self._wake_waiters()  # it may have been applied between the check and the append
        try:
            await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise DeadlineExceeded(
                f"shard {self.config.shard} has applied {self.shard.applied}, not yet {wanted}"
            ) from None

    async def tail(self) -> str:
        """The newest position in this shard's log (for STRONG reads)."""
        try:
            reply = await self._async.xrevrange(self.key, count=1)
        except redis.RedisError as exc:
            raise Unavailable(f"reading the log tail of shard {self.config.shard}: {exc}") from exc
        return reply[0][0].decode() if reply else positions.ZERO
