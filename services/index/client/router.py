"""Fan-out of a search to every index shard and merge of the top-k (used by the gateway).

Every shard gets the whole query batch in parallel with the remaining deadline (minus a
small reserve for the merge and what the caller does next). Within a shard a search goes
to the replica with the fewest searches in flight (a fixed list, or the addresses of a
``dns:///name:port`` target, resolved again every few seconds), failing over to the next
one on UNAVAILABLE and hedging to it when the first is slower than its recent p95
(:mod:`services.index.client.replicas`). A shard that
does not answer in time, or whose replicas are all down, is reported in
``missing_shards`` (a partial result) unless the caller asked for complete results, in
which case the search fails with that shard's error (Unavailable or DeadlineExceeded).
When no shard at all answered, the search fails (DeadlineExceeded or Unavailable): an
OK with zero hits from zero shards would tell the caller that nothing matched. A
shard's INVALID_ARGUMENT fails the search: it is the caller's mistake, not an outage.

Coalescing: concurrent single-vector, unfiltered EVENTUAL/STRONG searches are sent to
the shards together. While ``max_waves`` fan-outs are in flight, new requests queue;
the next wave carries every queued request with the same nprobe, consistency,
completeness and deadline class (remaining budgets within 2×, :func:`deadline_class`)
(up to 256 vectors, k = the largest k asked) as one ShardSearchRequest per shard, with
the latest deadline among them; each request waits no longer than its own deadline.
An idle router sends a request at once.
This cuts the RPCs per query by the batch size, and the shards run the batch as one
FAISS call. SESSION and filtered searches are never coalesced (their waits and
selectors are their own).

Sparse and hybrid searches (``texts`` and ``sparse_k``, issue #26) go the same way: each
shard answers its dense and its BM25 list of the same batch in one message, the router
merges each list over the shards (:func:`merge_answers`; BM25 scores are each shard's,
as in Elasticsearch's query-then-fetch) and leaves the fusion to the caller. A shard
that answers without a sparse list (no text index) is in ``sparse_missing_shards``.
Waves hold one kind of search (dense, sparse or both).

The merge (:func:`merge_results`, :func:`split_result`) is pure and
unit-tested; only :class:`ShardRouter` and its coalescer touch grpc.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from retrieval.v1 import index_pb2, index_pb2_grpc
from services.common.balance import Balancing
from services.common.deadline import Deadline
from services.common.domain import Hit, IndexResult
from services.common.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    RetrievalError,
    Unavailable,
)
from services.common.limits import MAX_K
from services.common.tls import ClientTLS
from services.index import convert
from services.index.client.replicas import HedgePolicy, Replica, ReplicaSet
from services.index.core.coarse import CoarseQuantizer
from services.index.core.query import (
    PAD_ID,
    Consistency,
    IndexQuery,
    Probes,
    ShardAnswer,
    TopK,
)

log = logging.getLogger(__name__)

# Time kept back from the shards for merging and answering.
RESERVE_FRACTION = 0.1
RESERVE_MIN_S = 0.005
OUTAGES = (Unavailable, DeadlineExceeded)
QUANTIZER_RETRY_S = 30.0  # after a failed fetch of the shared quantizer


def merge_results(
    answers: Sequence[ShardAnswer | BaseException],
    num_queries: int,
    k: int,
    require_complete: bool,
) -> IndexResult:
    """Merge the shards' answers (in shard order); outages become ``missing_shards``.

    Vectorised over the batch: the shards' score grids side by side, one stable sort
    per row (ties: the lower shard first, then the shard's own order), and Python
    objects only for the k hits kept per query.
    """
    tops: list[TopK] = []
    shard_of: list[int] = []
    missing: list[int] = []
    for shard, answer in enumerate(answers):
        if isinstance(answer, OUTAGES) and not require_complete:
            log.warning("partial result without shard %d: %s", shard, answer)
            missing.append(shard)
            continue
        if isinstance(answer, BaseException):
            raise answer
        if answer.top.rows != num_queries:
            raise Unavailable(f"shard {shard} answered {answer.top.rows} of {num_queries}")
        if answer.top.width:
            tops.append(answer.top)
            shard_of.append(shard)
    if len(missing) == len(answers):
        raise no_shard_answered(answers)
    if not tops:
        return IndexResult([[] for _ in range(num_queries)], missing)
    widths = np.array([t.width for t in tops])
    starts = np.concatenate([[0], np.cumsum(widths)[:-1]])
    scores = np.concatenate([t.scores for t in tops], axis=1)
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    which = np.searchsorted(starts, order, side="right") - 1  # index into tops
    flat = np.arange(num_queries)[:, None] * widths[which] + (order - starts[which])
    kept = np.take_along_axis(scores, order, axis=1).tolist()
    ids = [t.ids for t in tops]
    hits = [
        [
            Hit(ids[t][f], s, shard_of[t], s)
            for t, f, s in zip(t_row, f_row, s_row, strict=True)
            if ids[t][f] != PAD_ID
        ]
        for t_row, f_row, s_row in zip(which.tolist(), flat.tolist(), kept, strict=True)
    ]
    return IndexResult(hits, missing)


def merge_answers(
    answers: Sequence[ShardAnswer | BaseException],
    num_queries: int,
    k: int,
    sparse_k: int,
    require_complete: bool,
) -> IndexResult:
    """:func:`merge_results` of the dense lists (none when ``k`` is 0: a sparse-only
    search) and, with ``sparse_k``, of the sparse ones."""
    if k:
        result = merge_results(answers, num_queries, k, require_complete)
    else:
        empty = TopK.empty(num_queries, 0)
        blank = [
            dataclasses.replace(a, top=empty) if isinstance(a, ShardAnswer) else a for a in answers
        ]
        result = merge_results(blank, num_queries, 1, require_complete)
    if not sparse_k:
        return result
    lists: list[ShardAnswer | BaseException] = []
    for shard, answer in enumerate(answers):
        if not isinstance(answer, ShardAnswer):
            lists.append(answer)
        elif answer.sparse is None:
            result.sparse_missing_shards.append(shard)
            lists.append(Unavailable(answer.sparse_unavailable or f"shard {shard}: no sparse list"))
        else:
            lists.append(dataclasses.replace(answer, top=answer.sparse))
    if len(result.sparse_missing_shards) + len(result.missing_shards) == len(answers):
        result.sparse = [[] for _ in range(num_queries)]  # nothing to merge: dense only
    else:
        result.sparse = merge_results(lists, num_queries, sparse_k, False).hits
    return result


def no_shard_answered(answers: Sequence[ShardAnswer | BaseException]) -> RetrievalError:
    """The error of a search that no shard answered: an empty OK would claim "no match".

    DeadlineExceeded when the time ran out on any shard (the caller's budget is spent),
    else Unavailable (every replica of every shard is down: safe to retry).
    """
    details = "; ".join(str(a) for a in answers)
    if any(isinstance(a, DeadlineExceeded) for a in answers):
        return DeadlineExceeded(f"no shard answered within the deadline ({details})")
    return Unavailable(f"no shard answered ({details})")


def split_result(
    result: IndexResult, ks: Sequence[int], sparse_ks: Sequence[int] | None = None
) -> list[IndexResult]:
    """One result per coalesced request (one query row each), cut to its own k (and
    sparse k)."""
    sparse_ks = sparse_ks if sparse_ks is not None else [0] * len(ks)
    sparse = result.sparse
    return [
        IndexResult(
            hits=[row[:k]],
            missing_shards=list(result.missing_shards),
            sparse=None if sparse is None else [sparse[i][:sk]],
            sparse_missing_shards=list(result.sparse_missing_shards),
        )
        for i, (row, k, sk) in enumerate(zip(result.hits, ks, sparse_ks, strict=True))
    ]


def shard_deadline(overall: Deadline) -> Deadline:
    """The overall deadline minus the router's reserve."""
    remaining = overall.remaining()
    if remaining is None:
        return overall
    return Deadline.after(max(0.0, remaining - max(RESERVE_MIN_S, remaining * RESERVE_FRACTION)))


class _Shard:
    """The replicas of one shard (:class:`ReplicaSet`: balancing, failover, hedging),
    and the calls that any one replica answers for the shard."""

    def __init__(
        self,
        index: int,
        addresses: Sequence[str],
        policy: HedgePolicy,
        tls: ClientTLS | None = None,
        balancing: Balancing | None = None,
    ) -> None:
        self.index = index
        self.replicas = ReplicaSet(index, addresses, policy, tls, balancing=balancing)

    async def search(
        self, request: index_pb2.ShardSearchRequest, deadline: Deadline
    ) -> ShardAnswer:
        return await self.replicas.search(request, deadline)

    async def quantizer(self) -> CoarseQuantizer | None:
        """The trained quantizer from whichever replica gives it first (None if none).

        Every replica is asked at once: asked one after the other, a hung replica first
        in the list held the first search of a new router for the call's 5 s timeout."""

        async def one(replica: Replica) -> CoarseQuantizer:
            try:
                reply = await replica.stub.Quantizer(index_pb2.QuantizerRequest(), timeout=5.0)
                return convert.quantizer_from_pb(reply)
            except (grpc.aio.AioRpcError, RetrievalError) as exc:
                log.warning(
                    "no quantizer from shard %d replica %s: %s", self.index, replica.address, exc
                )
                raise

        tasks = [asyncio.ensure_future(one(r)) for r in await self.replicas.current()]
        try:
            for answer in asyncio.as_completed(tasks):
                try:
                    return await answer
                except (grpc.aio.AioRpcError, RetrievalError):
                    continue
            return None
        finally:
            for task in tasks:
                task.cancel()

    async def stats(self) -> list[index_pb2.ShardStats | None]:
        async def one(stub: index_pb2_grpc.IndexShardServiceStub) -> index_pb2.ShardStats | None:
            try:
                reply: index_pb2.ShardStats = await stub.Stats(
                    index_pb2.ShardStatsRequest(), timeout=5.0
                )
                return reply
            except grpc.aio.AioRpcError:
                return None

        replicas = await self.replicas.current()
        return list(await asyncio.gather(*[one(r.stub) for r in replicas]))

    async def close(self) -> None:
        await self.replicas.close()


@dataclass
class _Waiting:
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


# A queued search waits for a wave slot at most this share of its time (see _Coalescer).
LAUNCH_BY_SHARE = 0.5


def _left(waiting: _Waiting) -> float:
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


class _Coalescer:
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

    def __init__(self, router: ShardRouter, max_waves: int) -> None:
        self._router = router
        self._waves = asyncio.Semaphore(max_waves)
        self._queue: dict[_WaveKey, list[_Waiting]] = {}
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
            _Waiting(
                vector,
                query.k,
                deadline,
                future,
                text,
                query.sparse_k,
                launch_by,
                shard_deadline(deadline),
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
        ``launch_by``. Woken early when a search that must leave sooner is queued."""
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

    async def _run(self, key: _WaveKey, wave: list[_Waiting]) -> None:
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


class ShardRouter:
    """``ShardRouter([["host:port", ...replicas of shard 0], [...shard 1], ...])``.

    ``coalesce=True`` (default) batches concurrent single-query searches (see above);
    ``max_waves`` fan-outs may be in flight at once. ``share_quantizer=True`` (default)
    assigns each batch to its inverted lists once, here, instead of once per shard
    (:mod:`services.index.core.coarse`). ``hedge`` says when a slow replica's search is also
    sent to another one (:class:`HedgePolicy`; ``HedgePolicy(enabled=False)``: never).
    ``balancing`` picks a shard's replica (:class:`Balancing`: least outstanding
    searches by default; how often a ``dns:`` target is resolved again).
    """

    def __init__(
        self,
        shards: Sequence[Sequence[str]],
        *,
        coalesce: bool = True,
        max_waves: int = 2,
        share_quantizer: bool = True,
        hedge: HedgePolicy | None = None,
        tls: ClientTLS | None = None,
        balancing: Balancing | None = None,
    ) -> None:
        if not shards:
            raise ValueError("at least one shard is needed")
        policy = hedge or HedgePolicy()
        self._shards = [
            _Shard(i, replicas, policy, tls, balancing) for i, replicas in enumerate(shards)
        ]
        self.num_shards = len(self._shards)
        self._coalescer = _Coalescer(self, max_waves) if coalesce else None
        self._share_quantizer = share_quantizer
        self._quantizer: CoarseQuantizer | None = None
        self._quantizer_retry_at = 0.0

    async def search(self, query: IndexQuery, timeout: float | None = None) -> IndexResult:
        """Top-k per query vector over all shards, best first (and the BM25 lists that
        ``query`` asks for in ``IndexResult.sparse``: :class:`IndexQuery`). ``timeout`` in
        seconds (None = none)."""
        vectors, k, texts, sparse_k = query.vectors, query.k, query.texts, query.sparse_k
        if vectors is not None:
            vectors = np.ascontiguousarray(vectors, dtype=np.float32)
            if vectors.ndim != 2 or len(vectors) == 0:
                raise InvalidArgument(f"queries: expected a (n, dim) matrix, got {vectors.shape}")
            if not 1 <= k <= MAX_K:
                raise InvalidArgument(f"k: {k} is out of range 1..{MAX_K}")
            if vectors is not query.vectors:  # a copy was made (another dtype or layout)
                query = dataclasses.replace(query, vectors=vectors)
        elif k or not sparse_k:
            raise InvalidArgument("a search needs query vectors, or texts and sparse_k only")
        if sparse_k or texts:
            if not 1 <= sparse_k <= MAX_K:
                raise InvalidArgument(f"sparse_k: {sparse_k} is out of range 1..{MAX_K}")
            if not texts or (vectors is not None and len(texts) != len(vectors)):
                raise InvalidArgument("texts: one query text per query vector")
        if query.write_token:
            unknown = [s for s in query.write_token if not 0 <= s < self.num_shards]
            if unknown:
                raise InvalidArgument(f"write_token: unknown shards {unknown}")
        if (
            self._coalescer is not None
            and query.rows == 1
            and not query.filter
            and query.consistency is not Consistency.SESSION
        ):
            return await self._coalescer.search(query, timeout)
        return await self.fan_out(query, timeout)

    async def fan_out(self, query: IndexQuery, timeout: float | None) -> IndexResult:
        """One ShardSearchRequest per shard for the whole batch; merge the answers."""
        tasks = await self.launch(query, shard_deadline(Deadline.after(timeout)))
        try:
            answers = await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            for task in tasks:
                task.cancel()
        dense_k = query.k if query.vectors is not None else 0
        return merge_answers(answers, query.rows, dense_k, query.sparse_k, query.require_complete)

    async def launch(
        self, query: IndexQuery, deadline: Deadline
    ) -> list[asyncio.Task[ShardAnswer]]:
        """Send one ShardSearchRequest per shard for the whole batch: the tasks of their
        answers, in shard order (the caller merges what it waits for).

        With the shared quantizer, the batch is assigned here; should a shard have other
        centroids (FailedPrecondition: the index was retrained), the router forgets its
        copy and sends that shard the batch again for it to assign itself (the shards
        that took the probes have the router's centroids: their answers stand).
        """
        probes: Probes | None = None
        if query.vectors is not None:
            quantizer = await self._coarse(query.vectors)
            if quantizer is not None:
                probes = quantizer.assign(query.vectors, query.nprobe)

        def request(shard: int, probes: Probes | None) -> index_pb2.ShardSearchRequest:
            return convert.query_to_pb(query.shard_query(shard, probes))

        async def one(shard: _Shard) -> ShardAnswer:
            if probes is not None:
                try:
                    return await shard.search(request(shard.index, probes), deadline)
                except FailedPrecondition:
                    log.warning(
                        "shard %d refused this router's quantizer: fetching it again later",
                        shard.index,
                    )
                    self._quantizer = None
            return await shard.search(request(shard.index, None), deadline)

        return [asyncio.ensure_future(one(s)) for s in self._shards]

    async def _coarse(self, vectors: np.ndarray) -> CoarseQuantizer | None:
        """The shared quantizer when it applies to ``vectors`` (fetched on first use)."""
        if not self._share_quantizer:
            return None
        if self._quantizer is None and time.monotonic() >= self._quantizer_retry_at:
            self._quantizer_retry_at = time.monotonic() + QUANTIZER_RETRY_S
            self._quantizer = await self._shards[0].quantizer()
        q = self._quantizer
        if q is None or vectors.shape[1] != q.dim:
            return None  # a wrong dimension: the shards report it (FAISS would assert)
        return q

    async def stats(self) -> list[list[index_pb2.ShardStats | None]]:
        """Stats of every replica of every shard (None for a replica that did not answer)."""
        return list(await asyncio.gather(*[s.stats() for s in self._shards]))

    async def close(self) -> None:
        for shard in self._shards:
            await shard.close()
