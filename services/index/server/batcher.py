"""Server-side micro-batching: concurrent single-query searches become one FAISS call.

Requests queue while the worker threads are busy; a free worker takes every queued
request with the same nprobe (up to ``max_rows`` vectors) and runs them as one batch,
with k = the largest k asked. FAISS amortises the coarse quantizer and the lookup tables
over the batch, so the service can beat one-query-at-a-time in-process throughput.
Filtered searches (their own selector) run alone.

``workers=0`` runs every search inline on the event-loop thread instead of in a thread
pool. The loop is then busy during a FAISS call, gRPC queues the requests that arrive
meanwhile, and they form the next (larger) batch; it also saves the thread hand-off
per batch. Measured with 2 shards on 2 cores (bench/index_service.py): 0.43 ms of
shard CPU per query inline against 0.48–0.52 with 2 worker threads, and ~25 % more
queries/s. A shard with cores of its own wants workers (or ``omp-threads`` > 1, which
FAISS spends inside one batch call).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import faiss
import numpy as np

from services.index.core.query import DenseQuery, Probes, TopK
from services.index.core.shard import IvfPqShard
from services.index.server.metrics import ShardMetrics


@dataclass
class _Pending:
    query: DenseQuery
    future: asyncio.Future[TopK] = field(repr=False)

    @property
    def rows(self) -> int:
        return len(self.query.vectors)

    @property
    def key(self) -> tuple[int, int]:
        """Requests batch together when their scans match: nprobe, and who assigned."""
        probes = self.query.probes
        return (self.query.nprobe, -1 if probes is None else probes.nprobe)


def _joined(batch: list[_Pending]) -> Probes | None:
    """The probes of a batch: its requests share a key, so all have probes or none do."""
    first = batch[0].query.probes
    if first is None or len(batch) == 1:
        return first
    given = [p.query.probes for p in batch if p.query.probes is not None]
    return Probes(
        first.quantizer,
        np.concatenate([p.lists for p in given]),
        np.concatenate([p.scores for p in given]),
    )


class SearchBatcher:
    def __init__(
        self,
        shard: IvfPqShard,
        workers: int = 2,
        max_rows: int = 256,
        metrics: ShardMetrics | None = None,
        omp_threads: int = 1,
    ) -> None:
        if workers < 0:
            raise ValueError("workers must be >= 0 (0 = inline on the event loop)")
        self.shard = shard
        self.max_rows = max_rows
        self.metrics = metrics
        self.inline = workers == 0
        # OpenMP's thread count is per thread: a worker would otherwise use the process
        # default (every core) in each of its FAISS calls.
        self._pool = ThreadPoolExecutor(
            max_workers=max(1, workers),
            thread_name_prefix="search",
            initializer=faiss.omp_set_num_threads,
            initargs=(omp_threads,),
        )
        self._slots = asyncio.Semaphore(max(1, workers))
        self._queue: deque[_Pending] = deque()
        self._draining = False
        self._tasks: set[asyncio.Future[None]] = set()  # keep running tasks referenced

    async def search(self, query: DenseQuery, *, checked: bool = False) -> TopK:
        """Top-k of ``query.vectors``, batched with concurrent searches. Checked here (a
        bad request must not join, and fail, a batch) unless the caller already did
        (``checked``: the shard service checks every request once, where it enters)."""
        if not checked:
            vectors = self.shard.check(
                query.vectors, query.k, query.nprobe, query.filter, query.probes
            )
            query = dataclasses.replace(query, vectors=vectors)
        loop = asyncio.get_running_loop()
        if query.filter:
            async with self._slots:
                return await self._call(query)
        pending = _Pending(query, loop.create_future())
        self._queue.append(pending)
        if not self._draining:
            self._draining = True
            self._keep(asyncio.ensure_future(self._drain()))
        return await pending.future

    async def _drain(self) -> None:
        try:
            while self._queue:
                await self._slots.acquire()
                batch = self._take()
                task = self._keep(asyncio.ensure_future(self._run(batch)))
                task.add_done_callback(lambda _t: self._slots.release())
        finally:
            self._draining = False

    def _keep(self, task: asyncio.Future[None]) -> asyncio.Future[None]:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _take(self) -> list[_Pending]:
        first = self._queue.popleft()
        batch, rows, rest = [first], first.rows, deque[_Pending]()
        while self._queue:
            item = self._queue.popleft()
            if item.key == first.key and rows + item.rows <= self.max_rows:
                batch.append(item)
                rows += item.rows
            else:
                rest.append(item)
        self._queue.extendleft(reversed(rest))
        return batch

    async def _run(self, batch: list[_Pending]) -> None:
        first = batch[0].query
        joined = DenseQuery(
            np.concatenate([p.query.vectors for p in batch]) if len(batch) > 1 else first.vectors,
            max(p.query.k for p in batch),
            first.nprobe,
            (),  # a filtered search runs alone
            _joined(batch),
        )
        try:
            hits = await self._call(joined)
        except Exception as exc:
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(exc)
            return
        if len(batch) == 1:
            if not batch[0].future.done():
                batch[0].future.set_result(hits)
            return
        row = 0
        for p in batch:
            n = p.rows
            if not p.future.done():
                p.future.set_result(hits.take(row, row + n, p.query.k))
            row += n

    async def _call(self, query: DenseQuery) -> TopK:
        """One FAISS call: inline on the event loop, or on a worker thread."""
        if self.inline:
            return self._timed(query)
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._timed, query)

    def _timed(self, query: DenseQuery) -> TopK:
        start = time.perf_counter()
        hits = self.shard.search_top_k(
            query.vectors, query.k, query.nprobe, query.filter, query.probes, checked=True
        )
        if self.metrics is not None:
            labels = self.metrics.labels
            self.metrics.search_seconds.labels(*labels).observe(time.perf_counter() - start)
            self.metrics.batch_size.labels(*labels).observe(len(query.vectors))
        return hits

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
