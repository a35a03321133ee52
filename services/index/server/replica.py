"""A replica of one shard: the in-memory shard kept in step with its Redis Stream.

Start: newest valid snapshot (or the trained, empty index) → register the replica's
snapshot position in ``snap:{shard}`` (so the log is never trimmed past it) → replay the
stream from that position → ready. Then a consumer thread XREADs new entries and applies
them in batches; every ``snapshot_every_entries`` applied changes or
``snapshot_every_s`` seconds it writes a snapshot and trims the log below the oldest
snapshot position of all replicas of the shard.

A replica serves one index generation (``--generation``, docs/generations.md): the log it
follows, its registrations and its trims are that generation's (``log:{s}`` for g1,
``log:{N.s}:<gen>`` for another, :class:`~services.index.keys.GenerationKeys`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path
from typing import Any

import faiss
import redis
from redis.exceptions import RedisClusterException

from services.common import positions, timeouts
from services.common.encoder_spec import EncoderSpec
from services.common.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    Unavailable,
)
from services.common.positions import ZERO_POSITION, Position
from services.index.changelog import LogReader, decode_entry, text
from services.index.core.changes import Change, Upsert
from services.index.core.snapshots import (
    Snapshot,
    list_snapshots,
    load_newest,
    write_snapshot,
)
from services.index.core.trained import TrainedIndex
from services.index.keys import FIRST_GENERATION, GENERATIONS_KEY, GenerationKeys, Layout
from services.index.layout import check_layout, read_layout
from services.index.records import ensure_first
from services.index.server.folders import claim_snapshot_folder
from services.index.server.metrics import ShardMetrics
from services.index.server.refresh import Refresher
from services.index.server.settings import ShardSettings
from services.process.redis_client import async_client, sync_client
from services.telemetry import tracing

log = logging.getLogger(__name__)

# The newest position ever written to the log (its stream's last-generated-id), "0-0"
# when there is no stream yet: one round trip, no error text to interpret.
# A log apply span names at most this many of its entries (a replay reads hundreds at once).
MAX_TRACED_ENTRIES = 64

_LOG_END = """
if redis.call('EXISTS', KEYS[1]) == 0 then return '0-0' end
local info = redis.call('XINFO', 'STREAM', KEYS[1])
for i = 1, #info, 2 do
  if info[i] == 'last-generated-id' then return info[i + 1] end
end
return '0-0'
"""


class ShardReplica:
    def __init__(self, config: ShardSettings, metrics: ShardMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self.trained = TrainedIndex.load(Path(config.index_dir))
        self.text_config = config.text_config()
        claim_snapshot_folder(Path(config.snapshot_dir), config.generation)
        self.shard, snapshot = load_newest(
            Path(config.snapshot_dir), self.trained, self.text_config
        )
        self.snapshot_position = snapshot.position if snapshot else positions.ZERO
        self.log_lag_s = 0.0
        self.refresher = Refresher(config.text_refresh_s)  # the text index's commits
        self.ready = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiters: list[tuple[Position, asyncio.Future[None]]] = []
        self._refreshing: asyncio.Future[None] | None = None  # a SESSION search's refresh
        self._since_snapshot = 0
        self._last_snapshot = time.monotonic()
        self._last_heartbeat = time.monotonic()
        self._sync = sync_client(config.redis_url, socket_timeout=10.0)
        self.keys = self._generation_keys()
        self.log = LogReader(self._sync, config.shard, self.keys)
        self.skipped_entries = 0
        self._snapshot_lock = threading.Lock()
        self._async: Any = async_client(config.redis_url, max_connections=64, socket_timeout=5.0)
        self._read_log_end = self._async.register_script(_LOG_END)
        # The newest log end read so far: it only grows (a stream's last-generated-id
        # never goes back), so a position at or below it needs no read.
        self.known_written = ZERO_POSITION
        self._end_reads = 0  # log-end reads started so far
        self._end_read: tuple[int, asyncio.Task[Position]] | None = None  # the newest of them
        # shard.applied (a string, the shard core's) and its parse, redone only when it moves
        self._applied: tuple[str, Position] = ("", ZERO_POSITION)

    @property
    def key(self) -> str:
        return self.keys.log(self.config.shard)

    @property
    def generation(self) -> str:
        return self.config.generation

    def _generation_keys(self) -> GenerationKeys:
        """The keys of the generation this replica serves (docs/generations.md): g1's are
        those of the base layout, ``--shards`` shards (:func:`check_layout` checks that at
        start); another generation's layout is its shard count over the store's base,
        read from ``gtr:layout`` (FailedPrecondition when the store has none yet)."""
        shards = self.config.shards
        if self.config.generation == FIRST_GENERATION:
            return GenerationKeys(FIRST_GENERATION, Layout(shards, shards))
        base = read_layout(self._sync).get("shards")
        if base is None:
            raise FailedPrecondition(
                f"generation {self.config.generation}: the store has no key layout yet "
                "(gtr:layout); generation g1's gateway or shards record it"
            )
        return GenerationKeys(self.config.generation, Layout(shards, int(base)))

    # --- lifecycle -------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Register this replica's snapshot position, then consume the log in a thread.

        FailedPrecondition when the log was trimmed past our position: a replay would
        silently miss changes; seed the snapshot directory from a peer replica instead.
        Also when Redis holds another key layout or shard count (:func:`check_layout`).
        """
        self._loop = loop
        if self.metrics is not None:
            self.metrics.bind(self.shard)
            self.metrics.watch_log(self.log, lambda: self.shard.applied)
        check_layout(self._sync, self.config.shards, self.config.generation)
        if self.config.generation == FIRST_GENERATION and not self._sync.exists(GENERATIONS_KEY):
            # a store written before generations (or a new one) becomes generation g1
            manifest = self.trained.manifest
            ensure_first(
                self._sync,
                self.config.shards,
                EncoderSpec(model=manifest.model, dim=manifest.dim, source="shard manifest"),
                str(Path(self.config.index_dir).resolve()),
            )
        if self.trimmed():
            raise FailedPrecondition(
                f"{self.key} was trimmed past {self.shard.applied}: copy a "
                f"snapshot of a peer replica into {self.config.snapshot_dir} (or start "
                "with --peers: it seeds itself)"
            )
        self.log.register_snapshot(self.config.replica, self.replay_floor())
        self._thread = threading.Thread(target=self._consume, name="log-consumer", daemon=True)
        self._thread.start()

    def trimmed(self) -> bool:
        """Whether the log was trimmed past what this replica has loaded (a replay from
        there would miss changes: seed from a peer, :mod:`services.index.server.seeding`)."""
        return bool(self.log.trimmed_past(self.shard.applied))

    def reload(self) -> None:
        """Load the newest valid snapshot again (one a peer just sent); before start()."""
        old = self.shard
        self.shard, snapshot = load_newest(
            Path(self.config.snapshot_dir), self.trained, self.text_config
        )
        if old.text is not None:
            old.text.close()
        self.snapshot_position = snapshot.position if snapshot else positions.ZERO

    @property
    def consuming(self) -> bool:
        """Whether the log consumer thread is alive: the shard's health check.

        A dead consumer is not restarted in place; the replica reports NOT_SERVING (the
        process's health watcher) and stays so until the process is restarted (the
        chart's gRPC liveness probe does that after 30 s). Why not a restart with
        backoff: the loop already retries what is transient (a Redis error, a
        malformed entry is skipped), so the thread ends only on what is not: a FAISS
        apply that failed halfway (the in-memory index may hold part of a batch whose
        position was never recorded; applying it again from ``applied`` would add the
        same ids twice) or a snapshot that cannot be written (a full disk, a directory
        gone), which fails again on the next pass. A restarted thread would either run
        on an index in an unknown state or fail in a loop while the replica answers from
        an index that no longer follows its log. A new process loads the newest valid
        snapshot and replays the log: the one path known to rebuild a correct index.
        """
        return self._thread is not None and self._thread.is_alive()

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
        faiss.omp_set_num_threads(self.config.omp_threads)  # per thread: not inherited
        try:
            tail = self.log.tail()
            if positions.at_least(self.shard.applied, tail):
                self.ready.set()
            while not self._stop.is_set():
                try:  # from what the vectors hold: the text may wait for its refresh
                    entries = self.log.read(
                        self.shard.staged, self.config.read_count, self.config.block_ms
                    )
                except redis.RedisError as exc:
                    log.warning("reading %s failed (%s); retrying", self.key, exc)
                    self._stop.wait(0.5)
                    continue
                if entries:
                    self._apply(entries)
                elif not self.shard.pending:
                    self._set_lag(0.0)
                if self.shard.pending and (
                    self.refresher.due(self.shard)
                    or self._waiters  # a SESSION search waits (read on the loop's side too)
                    or not (entries or self.ready.is_set())  # the replay has caught up
                ):
                    self.refresh()
                if not self.ready.is_set() and positions.at_least(self.shard.applied, tail):
                    log.info("shard %d replayed to %s", self.config.shard, self.shard.applied)
                    self.ready.set()
                self._maybe_snapshot()
                self._maybe_heartbeat()
        except Exception:
            log.exception("log consumer of shard %d stopped", self.config.shard)
            raise

    def _decode(self, position: str, fields: dict[bytes, bytes]) -> list[Change]:
        """The changes of one entry, or none when it is malformed (logged, skipped).

        Every replica skips the same entries, so replicas still converge; the gateway
        validates before logging, so a bad entry means a foreign or broken writer.
        """
        try:
            changes = decode_entry(fields)
            for change in changes:
                if isinstance(change, Upsert):
                    self.shard.check_vector(change.vector)
            return changes
        except Exception as exc:
            self.skipped_entries += 1
            log.error("%s entry %s skipped: %s", self.key, position, exc)
            return []

    def _apply(self, entries: list[tuple[str, dict[bytes, bytes]]]) -> None:
        # A trace of its own (tracing on): the apply runs after, and apart from, the write
        # that logged the entries; the write's "redis upsert script" span names the same
        # entries (gtr.log.entries), which is how one is found from the other (a log
        # entry carries no trace context: docs/tracing.md).
        with tracing.span("log apply") as span:
            if span:
                span.set_attributes(self._apply_attributes(entries))
            self._apply_entries(entries)

    def _apply_attributes(self, entries: list[tuple[str, dict[bytes, bytes]]]) -> dict[str, Any]:
        shard = self.config.shard
        named = entries[:MAX_TRACED_ENTRIES]
        return {
            "gtr.shard": shard,
            "gtr.replica": self.config.replica,
            "gtr.log.count": len(entries),
            "gtr.log.first": entries[0][0],
            "gtr.log.last": entries[-1][0],
            "gtr.log.entries": ",".join(f"{shard}:{position}" for position, _ in named),
        }

    def _apply_entries(self, entries: list[tuple[str, dict[bytes, bytes]]]) -> None:
        oldest_ms = positions.ms_of(entries[0][0])
        changes: list[Change] = []
        for position, fields in entries:
            changes.extend(self._decode(position, fields))
        last = entries[-1][0]
        # the vectors at once, the text at the next refresh (services/index/server/refresh.py)
        self.shard.apply(changes, last, refresh=False)
        self.refresher.applied(oldest_ms)
        self._since_snapshot += len(changes)
        if self.metrics is not None:
            self.metrics.applied_vectors.labels(*self.metrics.labels).inc(len(changes))

    def refresh(self) -> None:
        """Make what was applied searchable in the text index too (``shard.applied``
        moves) and wake the searches waiting for it. Thread-safe."""
        lag = self.refresher.refresh(self.shard)
        if lag is not None:  # the oldest entry's age when it became searchable
            self._set_lag(lag)
            if self.metrics is not None:
                self.metrics.text_refreshes.labels(*self.metrics.labels).inc()
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake_waiters)

    def _set_lag(self, seconds: float) -> None:
        # The Stats RPC's figure; the metric is read from the log on scrape (it grows
        # while nothing is applied): ShardMetrics.watch_log.
        self.log_lag_s = seconds

    def _maybe_snapshot(self) -> None:
        due_entries = self._since_snapshot >= self.config.snapshot_every_entries
        due_time = (
            self._since_snapshot > 0
            and time.monotonic() - self._last_snapshot >= self.config.snapshot_every_s
        )
        if due_entries or due_time:
            self.snapshot()

    def snapshot(self) -> Snapshot:
        """Write a snapshot now, record its position in Redis, trim the log below the
        oldest snapshot position of all replicas of this shard."""
        with self._snapshot_lock:
            self.refresh()  # (the export would refresh anyway: this keeps the lag true)
            snap = write_snapshot(
                self.shard, Path(self.config.snapshot_dir), self.config.keep_snapshots
            )
            self.snapshot_position = snap.position
            self._since_snapshot = 0
            self._last_snapshot = time.monotonic()
        try:
            self._register()
            self.log.trim_below_snapshots(self.config.stale_replica_s)
        except redis.RedisError as exc:
            log.warning("could not record snapshot position / trim (%s)", exc)
        return snap

    def _maybe_heartbeat(self) -> None:
        """Re-register this replica's floor now and then, so that an idle but live replica
        is never taken for a removed one (`stale_replica_s`)."""
        if time.monotonic() - self._last_heartbeat < self.config.heartbeat_s:
            return
        try:
            self._register()
        except redis.RedisError as exc:
            log.warning("could not refresh the replica registration (%s)", exc)

    def _register(self) -> None:
        """Record this replica's replay floor and that it is alive (the heartbeat)."""
        self._last_heartbeat = time.monotonic()
        self.log.register_snapshot(self.config.replica, self.replay_floor())

    def replay_floor(self) -> str:
        """The oldest position this replica may need to replay from: that of its oldest
        kept snapshot (a corrupt newer one falls back to it), or what it has loaded."""
        kept = [s.position for s in list_snapshots(Path(self.config.snapshot_dir))]
        if not kept:
            return self.snapshot_position
        return positions.oldest(self.snapshot_position, *kept)

    # --- waiting for positions (event loop side) -----------------------------------------
    # Typed positions here: a SESSION search's position is parsed once (ShardService.search),
    # the applied one once per applied batch, and every comparison is of two Positions.

    def applied_position(self) -> Position:
        """``shard.applied`` parsed, from a cache kept while it does not move."""
        applied = self.shard.applied
        cached, parsed = self._applied
        if applied is not cached and applied != cached:
            parsed = Position.parse(applied)
            self._applied = (applied, parsed)
        return parsed

    def _wake_waiters(self) -> None:
        still = []
        applied = self.applied_position()
        for wanted, future in self._waiters:
            if future.done():
                continue
            if applied >= wanted:
                future.set_result(None)
            else:
                still.append((wanted, future))
        self._waiters = still

    async def wait_for(self, wanted: Position | str, timeout: float | None) -> None:
        """Return once ``wanted`` is applied; DeadlineExceeded when ``timeout`` runs out."""
        wanted = Position.of(wanted)
        if self.applied_position() >= wanted:
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((wanted, future))
        self._wake_waiters()  # it may have been applied between the check and the append
        if not future.done() and Position.parse(self.shard.staged) >= wanted:
            self._refresh_soon()  # in the vectors, its text waiting for the refresh: now
        try:
            await timeouts.wait_for(future, timeout)
        except TimeoutError:
            raise DeadlineExceeded(
                f"shard {self.config.shard} has applied {self.shard.applied}, not yet {wanted}"
            ) from None

    def _refresh_soon(self) -> None:
        """A refresh in a worker thread, unless one is running (the consumer also
        refreshes on its next pass while a search waits)."""
        if self._refreshing is not None and not self._refreshing.done():
            return
        self._refreshing = asyncio.get_running_loop().run_in_executor(None, self.refresh)
        self._refreshing.add_done_callback(_log_failure)

    async def check_written(self, wanted: Position | str, timeout: float | None) -> None:
        """InvalidArgument when ``wanted`` (a SESSION token's position for this shard) is
        past the newest position ever written to the shard's log (its stream's
        last-generated-id): a token of another store, or a forged one, that no wait could
        ever satisfy.

        Free when the position is applied already or at most :attr:`known_written`, the
        newest log end this replica has read (it only grows); else it awaits one read of
        the log end shared by every search that asks meanwhile (:meth:`log_end`): a burst
        of SESSION searches for a write not yet applied costs Redis one round trip, not
        one each. Redis losing acknowledged writes (a failover, a restart without AOF)
        can move the end back; the remembered end then lets through a token the store no
        longer knows, and that search waits until its deadline, as it did before this
        check existed. When Redis cannot tell (down, slow), nothing is decided here: the
        wait that follows needs Redis too and ends with the deadline as before."""
        wanted = Position.of(wanted)
        if self.applied_position() >= wanted or self.known_written >= wanted:
            return
        try:
            last = await timeouts.wait_for(self.log_end(enough=wanted), timeout)
        except (TimeoutError, Unavailable):
            return
        if wanted > last:
            raise InvalidArgument(
                f"write_token: position {wanted} of shard {self.config.shard} is past the end "
                f"of its log (the newest written is {last}): a token of another store, a "
                "forged one, or one of a write lost when Redis failed over"
            )

    async def log_end(self, enough: Position | None = None) -> Position:
        """The newest position ever written to this shard's log, from a read that started
        after this call (so it sees every write acknowledged before the call), or, with
        ``enough``, the end already known once it reaches ``enough``. Calls that come
        while a read is in flight wait for it and then share the next one: at most one
        read in flight per replica. Unavailable when Redis cannot be read."""
        seen = self._end_reads
        while True:
            current = self._end_read
            if current is not None and current[0] > seen:
                return await asyncio.shield(current[1])
            if current is not None and not current[1].done():
                await asyncio.wait([current[1]])  # started before this call: not enough
                if enough is not None and self.known_written >= enough:
                    return self.known_written
                continue
            self._end_reads += 1
            task = asyncio.get_running_loop().create_task(self._fetch_log_end())
            task.add_done_callback(_retrieve)
            self._end_read = (self._end_reads, task)

    async def _fetch_log_end(self) -> Position:
        try:
            end = Position.parse(text(await self._read_log_end(keys=[self.key])))
        except (redis.RedisError, RedisClusterException) as exc:
            raise Unavailable(f"reading the log end of shard {self.config.shard}: {exc}") from exc
        self.known_written = max(self.known_written, end)
        return end

    async def tail(self) -> str:
        """The newest position in this shard's log (for STRONG reads)."""
        try:
            reply = await self._async.xrevrange(self.key, count=1)
        except redis.RedisError as exc:
            raise Unavailable(f"reading the log tail of shard {self.config.shard}: {exc}") from exc
        return reply[0][0].decode() if reply else positions.ZERO


def _retrieve(task: asyncio.Task[Position]) -> None:
    """Mark a shared read's failure as seen: every caller may have stopped waiting."""
    if not task.cancelled():
        task.exception()


def _log_failure(future: asyncio.Future[None]) -> None:
    """A refresh a search asked for failed: logged (the consumer's next refresh fails the
    same way, and stops the consumer: :attr:`ShardReplica.consuming`)."""
    if not future.cancelled() and future.exception() is not None:
        log.error("text index refresh failed: %s", future.exception())
