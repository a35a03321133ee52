"""Steady searches and writes through a gateway, recorded op by op, for the generation
tests and ``bench.rollout``: what each search answered (status, latency, the generation
that answered it) and each write (upsert or delete, acknowledged or not, the generation
and alias epoch its token names), and when the alias changed.

Both streams are *open loop*: a search (a write) starts every 1/rate seconds whatever the
earlier ones are doing, so a stall shows as latency, not as a lower rate. Writes keep
each document's operations in order (a document is never written by two calls at once):
new documents are upserted, acknowledged ones deleted, deleted ones upserted again, so a
replay that reorders or drops anything leaves a document present that was deleted or the
other way round.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from retrieval.v1 import common_pb2, documents_pb2, documents_pb2_grpc, search_pb2, search_pb2_grpc

WORDS = (
    "alpha",
    "beta",
    "gamma",
    "delta",
    "kappa",
    "sigma",
    "omega",
    "lumen",
    "vortex",
    "quark",
    "prism",
    "ember",
    "cobalt",
    "zephyr",
    "tundra",
    "quasar",
    "nimbus",
    "fjord",
    "saffron",
)
PROBE_KEY = "probe"  # every written document's metadata: {probe: its id}


@dataclass
class SearchOp:
    start: float
    end: float
    code: str  # "OK" or the gRPC status name
    generation: str = ""
    partial: bool = False
    detail: str = ""
    # the gateway's own stage timings (ms: encode, search, fetch, total) of an OK answer
    stages: dict[str, float] = field(default_factory=dict)

    @property
    def latency(self) -> float:
        return self.end - self.start


@dataclass
class WriteOp:
    doc_id: str
    kind: str  # "upsert" | "delete"
    start: float
    end: float = 0.0
    code: str = ""  # "" in flight, "OK" or the gRPC status name
    generation: str = ""
    epoch: int = 0
    positions: dict[int, str] = field(default_factory=dict)
    detail: str = ""
    text: str = ""  # an upsert's text

    @property
    def ok(self) -> bool:
        return self.code == "OK"


def token_of(pb: common_pb2.WriteToken) -> tuple[str, int, dict[int, str]]:
    """(generation, epoch, positions) of a write token; ("", 0, ...) when the proto has
    no generation fields (the gateway part of issue #24 not there)."""
    generation = str(getattr(pb, "generation", ""))
    epoch = int(getattr(pb, "epoch", 0))
    return generation, epoch, {p.shard: p.position for p in pb.positions}


def write_token(generation: str, epoch: int, positions: dict[int, str]) -> common_pb2.WriteToken:
    named: dict[str, Any] = {"generation": generation, "epoch": epoch} if generation else {}
    return common_pb2.WriteToken(
        positions=[common_pb2.ShardPosition(shard=s, position=p) for s, p in positions.items()],
        **named,
    )


def probe_filter(doc_id: str) -> common_pb2.Filter:
    return common_pb2.Filter(must=[common_pb2.FieldCondition(key=PROBE_KEY, any_of=[doc_id])])


@dataclass
class AliasChange:
    at: float
    serving: str
    epoch: int


@dataclass
class Recorded:
    searches: list[SearchOp] = field(default_factory=list)
    writes: list[WriteOp] = field(default_factory=list)
    aliases: list[AliasChange] = field(default_factory=list)
    skipped_searches: int = 0  # not started: too many in flight
    started: float = 0.0
    stopped: float = 0.0

    def search_rate(self) -> float:
        return len(self.searches) / max(self.stopped - self.started, 1e-9)

    def write_rate(self) -> float:
        done = [w for w in self.writes if w.ok]
        return len(done) / max(self.stopped - self.started, 1e-9)

    def timeline(self, bucket_s: float = 10.0) -> str:
        """Per ``bucket_s`` of the run: searches started, their p50/p99/max latency (ms),
        failed ones, the generations that answered, writes acknowledged, and the alias."""
        import numpy as np

        rows = []
        t = self.started
        while t < self.stopped:
            ss = [s for s in self.searches if t <= s.start < t + bucket_s]
            lat = np.asarray([s.latency for s in ss]) * 1e3 if ss else np.zeros(1)
            acked = sum(1 for w in self.writes if w.ok and t <= w.end < t + bucket_s)
            gens = ",".join(sorted({s.generation for s in ss}))
            alias = [f"{a.serving}@{a.epoch}" for a in self.aliases if t <= a.at < t + bucket_s]
            rows.append(
                f"{t - self.started:6.0f}s searches {len(ss):4d} p50 {np.median(lat):6.0f} "
                f"p99 {np.percentile(lat, 99):6.0f} max {lat.max():6.0f} ms failed "
                f"{sum(s.code != 'OK' for s in ss):3d} by {gens:<8} writes {acked:4d} "
                f"{' '.join(alias)}"
            )
            t += bucket_s
        return "\n".join(rows)

    def serving_between(self, start: float, end: float) -> set[str]:
        """Generations the alias named at some moment of [start, end] (as polled)."""
        names = set()
        current = None
        for change in self.aliases:
            if change.at <= start:
                current = change.serving
            elif change.at <= end:
                names.add(change.serving)
        if current is not None:
            names.add(current)
        return names


class SteadyLoad:
    """Searches at ``searches_per_s`` and writes at ``writes_per_s`` through ``gateway``
    until :meth:`stop`; the alias polled from ``redis_url`` every 20 ms when given."""

    def __init__(
        self,
        gateway: str,
        queries: list[str],
        *,
        searches_per_s: float = 25.0,
        writes_per_s: float = 12.0,
        search_timeout: float = 5.0,
        write_timeout: float = 10.0,
        max_in_flight: int = 64,
        redis_url: str | None = None,
        prefix: str = "w",
        seed: int = 0,
    ) -> None:
        self.gateway = gateway
        self.queries = queries
        self.searches_per_s = searches_per_s
        self.writes_per_s = writes_per_s
        self.search_timeout = search_timeout
        self.write_timeout = write_timeout
        self.max_in_flight = max_in_flight
        self.redis_url = redis_url
        self.prefix = prefix
        self.rng = random.Random(seed)
        self.record = Recorded()
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._live: list[str] = []  # acknowledged present, not being written
        self._deleted: list[str] = []  # acknowledged deleted, not being written
        self._next = 0

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> Recorded:
        self.record.started = time.monotonic()
        async with grpc.aio.insecure_channel(self.gateway) as channel:
            search = search_pb2_grpc.SearchServiceStub(channel)
            docs = documents_pb2_grpc.DocumentServiceStub(channel)
            loops = [
                self._ticker(self.searches_per_s, lambda: self._search(search)),
                self._ticker(self.writes_per_s, lambda: self._write(docs)),
            ]
            if self.redis_url is not None:
                loops.append(self._watch_alias())
            await asyncio.gather(*loops)
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)
        self.record.stopped = time.monotonic()
        return self.record

    async def _ticker(self, rate: float, start_one: Any) -> None:
        if rate <= 0:
            return
        interval = 1.0 / rate
        due = time.monotonic()
        while not self._stop.is_set():
            due += interval
            delay = due - time.monotonic()
            if delay > 0:
                try:
                    await asyncio.wait_for(self._stop.wait(), delay)
                    return
                except TimeoutError:
                    pass
            task = start_one()
            if task is not None:
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    def _search(self, stub: Any) -> asyncio.Task[None] | None:
        if len(self._tasks) >= self.max_in_flight:
            self.record.skipped_searches += 1
            return None
        query = self.rng.choice(self.queries)
        return asyncio.ensure_future(self._one_search(stub, query))

    async def _one_search(self, stub: Any, query: str) -> None:
        start = time.monotonic()
        try:
            reply = await stub.Search(
                search_pb2.SearchRequest(query=query, k=10), timeout=self.search_timeout
            )
        except grpc.aio.AioRpcError as exc:
            self.record.searches.append(
                SearchOp(start, time.monotonic(), exc.code().name, detail=exc.details() or "")
            )
            return
        self.record.searches.append(
            SearchOp(
                start,
                time.monotonic(),
                "OK",
                str(getattr(reply, "generation", "")),
                bool(reply.partial),
                stages={
                    name: getattr(reply.timings, f"{name}_ms")
                    for name in ("encode", "search", "fetch", "total")
                },
            )
        )

    def _write(self, stub: Any) -> asyncio.Task[None] | None:
        """Of every 10 writes: 2 deletes of acknowledged documents, 1 upsert of a deleted
        one, 4 upserts of a new text over a live one (a new version), 3 upserts of new ones
        (a pool short of candidates writes a new one): the store grows by about a quarter
        of the write rate, and every kind of change crosses each switch."""
        self._next += 1
        n = self._next
        if n % 5 == 2 and self._live:
            doc_id = self._live.pop(self.rng.randrange(len(self._live)))
            return asyncio.ensure_future(self._one_write(stub, doc_id, "delete"))
        if n % 10 == 4 and self._deleted:
            doc_id = self._deleted.pop(self.rng.randrange(len(self._deleted)))
            return asyncio.ensure_future(self._one_write(stub, doc_id, "upsert"))
        if n % 10 in (1, 5, 7, 9) and len(self._live) > 10:
            doc_id = self._live.pop(self.rng.randrange(len(self._live)))
            return asyncio.ensure_future(self._one_write(stub, doc_id, "upsert"))
        return asyncio.ensure_future(self._one_write(stub, f"{self.prefix}-{n}", "upsert"))

    async def _one_write(self, stub: Any, doc_id: str, kind: str) -> None:
        op = WriteOp(doc_id, kind, time.monotonic())
        self.record.writes.append(op)
        try:
            if kind == "upsert":
                text = " ".join(self.rng.choice(WORDS) for _ in range(12)) + f" {doc_id}"
                op.text = text
                up = await stub.Upsert(
                    documents_pb2.UpsertRequest(
                        documents=[
                            documents_pb2.Document(
                                id=doc_id,
                                title=doc_id,
                                text=text,
                                metadata={PROBE_KEY: doc_id},
                            )
                        ]
                    ),
                    timeout=self.write_timeout,
                )
                pb = up.write_token
            else:
                gone = await stub.Delete(
                    documents_pb2.DeleteRequest(ids=[doc_id]), timeout=self.write_timeout
                )
                if gone.deleted != 1:
                    op.detail = f"deleted {gone.deleted}, not_found {list(gone.not_found)}"
                pb = gone.write_token
        except grpc.aio.AioRpcError as exc:
            op.end, op.code, op.detail = time.monotonic(), exc.code().name, exc.details() or ""
            return  # not acknowledged: the document is uncertain from here on
        op.end, op.code = time.monotonic(), "OK"
        op.generation, op.epoch, op.positions = token_of(pb)
        (self._live if kind == "upsert" else self._deleted).append(doc_id)

    async def _watch_alias(self) -> None:
        import redis.asyncio as aioredis

        from services.generations.registry import read_alias

        client = aioredis.Redis.from_url(self.redis_url)  # type: ignore[arg-type]
        try:
            last = None
            while not self._stop.is_set():
                try:
                    alias = await read_alias(client)
                except Exception:  # a Redis hiccup: the next poll tells
                    alias = None
                if alias is not None and (alias.serving, alias.epoch) != last:
                    last = (alias.serving, alias.epoch)
                    self.record.aliases.append(
                        AliasChange(time.monotonic(), alias.serving, alias.epoch)
                    )
                await asyncio.sleep(0.02)
        finally:
            await client.aclose()


def expected_presence(
    writes: list[WriteOp], *, before_epoch: int | None = None, acked_before: float | None = None
) -> tuple[set[str], set[str], set[str]]:
    """(present, absent, uncertain) written documents, as one generation must hold them.

    ``before_epoch``: a generation that stopped serving when the alias reached that epoch
    holds exactly the writes acknowledged under an older epoch (its own, and those replayed
    into it); None: every acknowledged write. ``acked_before``: only documents whose every
    write ended before that moment (a check that runs while writes go on). A document
    with a write that was not acknowledged is uncertain, and so is one still being written.
    """
    by_doc: dict[str, list[WriteOp]] = {}
    for op in writes:
        by_doc.setdefault(op.doc_id, []).append(op)
    present: set[str] = set()
    absent: set[str] = set()
    uncertain: set[str] = set()
    for doc_id, ops in by_doc.items():
        if any(not op.ok for op in ops) or (
            acked_before is not None and any(op.end > acked_before for op in ops)
        ):
            uncertain.add(doc_id)
            continue
        counted = [op for op in ops if before_epoch is None or op.epoch < before_epoch]
        if counted and counted[-1].kind == "upsert":
            present.add(doc_id)
        else:
            absent.add(doc_id)
    return present, absent, uncertain


def write_token_merged(ops: list[WriteOp]) -> common_pb2.WriteToken:
    """One token covering acknowledged writes of one generation (newest position per
    shard), with the newest generation/epoch among them."""
    from services.common import positions

    done = [op for op in ops if op.ok]
    newest = max(done, key=lambda op: op.epoch)
    merged = positions.merge_tokens(
        *[
            op.positions
            for op in done
            if op.generation == newest.generation and op.epoch == newest.epoch
        ]
    )
    return write_token(newest.generation, newest.epoch, merged)


def expected_texts(
    writes: list[WriteOp], *, before_epoch: int | None = None, acked_before: float | None = None
) -> dict[str, str]:
    """id → the text of its last counted upsert, for the documents
    :func:`expected_presence` says are present (the same arguments)."""
    present, _, _ = expected_presence(writes, before_epoch=before_epoch, acked_before=acked_before)
    out: dict[str, str] = {}
    for op in writes:
        if (
            op.doc_id in present
            and op.kind == "upsert"
            and (before_epoch is None or op.epoch < before_epoch)
        ):
            out[op.doc_id] = op.text
    return out
