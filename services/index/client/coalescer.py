"""The router's coalescer: concurrent single-query searches sent to the shards together.

Concurrent single-vector, unfiltered EVENTUAL/STRONG searches are sent to the shards
together. While ``max_waves`` fan-outs are in flight, new requests queue; the next wave
carries every queued request with the same nprobe, consistency, completeness and deadline
class (remaining budgets within 2×, :func:`deadline_class`) (up to 256 vectors, k = the
largest k asked) as one ShardSearchRequest per shard, with the latest deadline among them;
each request waits no longer than its own deadline. An idle router sends a request at
once. Waves hold one kind of search (dense, sparse or both). The fan-out itself is the
router's (:meth:`services.index.client.router.ShardRouter.launch`), reached through
:class:`Launcher`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from services.common.deadline import Deadline
from services.common.domain import IndexResult
from services.common.errors import DeadlineExceeded
from services.index.client.merge import merge_answers, shard_deadline, split_result
from services.index.core.query import Consistency, IndexQuery, ShardAnswer
from services.telemetry import tracing


class Launcher(Protocol):
    """What sends a wave: one ShardSearchRequest per shard, the tasks of their answers."""

    async def launch(
        self, query: IndexQuery, deadline: Deadline
    ) -> list[asyncio.Task[ShardAnswer]]: ...


@dataclass
class Waiting:
    vector: np.ndarray | None  # (dim,); None: a sparse-only search
    k: int
    deadline: Deadline
    future: asyncio.Future[IndexResult]
    text: str = ""  # the query text of a sparse or hybrid search
    sparse_k: int = 0
    launch_by: float = math.inf  # monotonic: past it, it goes without a wave slot
    # its deadline less the router's reserve, taken when it is queued: computed later, the
    # reserve (a share of what is left) would shrink to the 5 ms minimum
    answer_by: Deadline = dataclasses.field(default_factory=lambda: Deadline.after(None))
    # the span of the request it belongs to (tracing.capture(); None: tracing off): the
    # wave's span is the child of its first recorded member's, links the others, and each
    # of those links back to it
    trace: Any = None


# A queued search waits for a wave slot at most this share of its time (see Coalescer).
LAUNCH_BY_SHARE = 0.5


def _left(waiting: Waiting) -> float:
    remaining = waiting.answer_by.remaining()
    return math.inf if remaining is None else remaining


def _outcome(task: asyncio.Future[ShardAnswer], shard: int) -> ShardAnswer | BaseException:
    """A shard's answer, its error, or DeadlineExceeded while it has not answered."""
    if not task.done() or task.cancelled():
        return DeadlineExceeded(f"shard {shard} did not answer within the deadline")
    return task.exception() or task.result()


# nprobe, consistency, require_complete, (dense, sparse), deadline class (deadline_class)
_WaveKey = tuple[int, Consistency, bool, tuple[bool, bool], int]
MAX_WAVE_ROWS = 256


def deadline_class(remaining: float | None) -> int:
    """Requests are coalesced only within one class: remaining budgets within 2× of each
    other (log2 of the milliseconds left; -1 for none). A wave runs with the latest
    deadline of its members, each member waits no longer than its own: without classes,
    one client's 12 ms deadline gave the whole wave 12 ms and emptied the answers of the
    clients that had 5 s (measured: 65 % of them came back partial and empty)."""
    if remaining is None:
        return -1
    return max(0, math.floor(math.log2(max(remaining * 1000.0, 1.0))))


def _wave_key(query: IndexQuery, timeout: float | None) -> _WaveKey:
    """What the searches of one wave share: nprobe, consistency, completeness, which
    lists they ask for and their deadline class."""
    kinds = (query.vectors is not None, query.sparse_k > 0)
    return (query.nprobe, query.consistency, query.require_complete, kinds, deadline_class(timeout))


class Coalescer:
    """Waves of coalesced searches, ``max_waves`` in flight.

    Partial answers within every member's deadline: a wave runs with its latest member's
    deadline, and each member is answered at its own (less the router's reserve) by the
    shards that have answered by then, the others missing; a wave whose members are all
    answered cancels what it still waits for. A queued search waits for a slot at most
    ``LAUNCH_BY_SHARE`` of its time, then goes in a wave without one: the slots may be
    held by waves waiting on a shard whose replicas all hang (SIGSTOPped) until their
    members' deadlines, and a search queued behind them got no answer at all (24 of 26
    concurrent 1 s searches ended DEADLINE_EXCEEDED, ``test_gateway_faults.py``).
    """

    def __init__(self, router: Launcher, max_waves: int) -> None:
        self._router = router
        self._waves = asyncio.Semaphore(max_waves)
        self._queue: dict[_WaveKey, list[Waiting]] = {}
        self._draining = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._arrived = asyncio.Event()  # a search that must leave sooner was queued
        self._slot_wait_until = math.inf  # when the drain stops waiting for a slot

    async def search(self, query: IndexQuery, timeout: float | None) -> IndexResult:
        """The answer to ``query`` (one row, no filter, not SESSION) from the wave it joins."""
        future: asyncio.Future[IndexResult] = asyncio.get_running_loop().create_future()
        wave_key = _wave_key(query, timeout)
        launch_by = math.inf if timeout is None else time.monotonic() + timeout * LAUNCH_BY_SHARE
        deadline = Deadline.after(timeout)
        vector = query.vectors[0] if query.vectors is not None else None
        text = query.texts[0] if query.texts else ""
        self._queue.setdefault(wave_key, []).append(
            Waiting(
                vector,
                query.k,
                deadline,
                future,
                text,
                query.sparse_k,
                launch_by,
                shard_deadline(deadline),
                tracing.capture(),
            )
        )
        if launch_by < self._slot_wait_until:
            self._arrived.set()
        if not self._draining:
            self._draining = True
            self._keep(asyncio.ensure_future(self._drain()))
        try:
            async with asyncio.timeout(timeout):
                return await future
        except TimeoutError:
            raise DeadlineExceeded("no shard answered within the deadline") from None

    def _keep(self, task: asyncio.Future[None]) -> None:
        self._tasks.add(task)  # type: ignore[arg-type]
        task.add_done_callback(self._tasks.discard)  # type: ignore[arg-type]

    def _prune(self) -> None:
        """Drop the members whose own wait ended (their deadline): they ride no wave."""
        for key in list(self._queue):
            alive = [w for w in self._queue[key] if not w.future.done()]
            if alive:
                self._queue[key] = alive
            else:
                del self._queue[key]

    async def _slot(self) -> bool:
        """A wave slot (True), or none (False) once a queued search reaches its
        ``launch_by``. Woken early when a search that must leave sooner is queued. A
        free slot is taken at once: the wait below costs two tasks and a wait of its own,
        on every wave of a router that is not busy."""
        if not self._waves.locked():
            await self._waves.acquire()  # free: returns without suspending
            return True
        while True:
            self._prune()
            urgent = min(
                (w.launch_by for queued in self._queue.values() for w in queued),
                default=math.inf,
            )
            wait = urgent - time.monotonic()
            if wait <= 0:
                return False
            self._slot_wait_until = urgent
            self._arrived.clear()
            acquire = asyncio.ensure_future(self._waves.acquire())
            arrived = asyncio.ensure_future(self._arrived.wait())
            try:
                await asyncio.wait(
                    {acquire, arrived},
                    timeout=None if math.isinf(wait) else wait,
                    return_when=asyncio.FIRST_COMPLETED,
                )
            finally:
                self._slot_wait_until = math.inf
                arrived.cancel()
                if not acquire.done():
                    acquire.cancel()  # Semaphore.acquire gives a slot back when cancelled
            if acquire.done() and not acquire.cancelled():
                return True

    async def _drain(self) -> None:
        try:
            while True:
                self._prune()
                if not self._queue:
                    break
                slot = await self._slot()
                self._prune()
                if not self._queue:
                    if slot:
                        self._waves.release()
                    break
                # the queue holding the search that must leave first (FIFO on ties)
                key = min(self._queue, key=lambda q: min(w.launch_by for w in self._queue[q]))
                waiting = self._queue[key]
                # Everything queued goes in one wave: measured here, splitting the queue
                # over free slots costs more RPCs than the overlap gains.
                wave, rest = waiting[:MAX_WAVE_ROWS], waiting[MAX_WAVE_ROWS:]
                if rest:
                    self._queue[key] = rest
                else:
                    del self._queue[key]
                task = asyncio.ensure_future(self._run(key, wave))
                if slot:
                    task.add_done_callback(self._wave_done)
                self._keep(task)
        finally:
            self._draining = False

    def _wave_done(self, _task: asyncio.Future[None]) -> None:
        self._waves.release()

    async def _run(self, key: _WaveKey, wave: list[Waiting]) -> None:
        """One wave, in a span of its own (tracing on): the shards' searches are made
        under it, so each is its child, whichever request's task began the drain."""
        with tracing.batch_span("index wave", [w.trace for w in wave]):
            await self._wave(key, wave)

    async def _wave(self, key: _WaveKey, wave: list[Waiting]) -> None:
        nprobe, consistency, require_complete, (dense, sparse), _ = key
        # the shards get the latest answer_by of the wave; each member is answered by its own
        known = [w.answer_by.at for w in wave]
        latest = Deadline(None if None in known else max(t for t in known if t is not None))
        vectors = [w.vector for w in wave if w.vector is not None]
        k = max(w.k for w in wave) if dense else 0
        sparse_k = max(w.sparse_k for w in wave)
        try:
            query = IndexQuery(
                np.stack(vectors) if dense else None,
                k,
                nprobe=nprobe,
                consistency=consistency,
                require_complete=require_complete,
                texts=tuple(w.text for w in wave) if sparse else (),
                sparse_k=sparse_k,
            )
            tasks = await self._router.launch(query, latest)
        except Exception as exc:
            for w in wave:
                if not w.future.done():
                    w.future.set_exception(exc)
            return
        pending: set[asyncio.Future[ShardAnswer]] = set(tasks)
        parts: list[IndexResult] | BaseException | None = None
        try:
            for i in sorted(range(len(wave)), key=lambda j: _left(wave[j])):
                w = wave[i]
                if w.future.done():
                    continue
                if pending:
                    own = w.answer_by.remaining()
                    done, pending = await asyncio.wait(
                        pending, timeout=None if own is None else max(0.0, own)
                    )
                    if done:
                        parts = None  # more shards answered: merge again
                if parts is None:
                    answers = [_outcome(t, shard) for shard, t in enumerate(tasks)]
                    try:
                        merged = merge_answers(answers, len(wave), k, sparse_k, require_complete)
                        parts = split_result(
                            merged, [m.k for m in wave], [m.sparse_k for m in wave]
                        )
                    except Exception as exc:
                        parts = exc
                if w.future.done():
                    continue
                if isinstance(parts, BaseException):
                    w.future.set_exception(parts)
                else:
                    w.future.set_result(parts[i])
        finally:
            for task in pending:
                task.cancel()  # every member is answered: nobody waits for these
