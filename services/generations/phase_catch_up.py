"""The ``catch_up`` phase: replay the source's logs into the target from the saved
positions until the lag is at most ``switch_lag`` entries: each upsert with the entry's own
vectors when the target's encoder is the source's (:func:`reuses_logged_vectors`: no
Triton call), else re-embedded from its entry's text. The switch replays the rest with
:func:`replay` too, and a rollback is this phase from the serving generation's
``switch_in``. The catch-up's replay is bounded to a few times the write rate
(:class:`ReplayBound`); the switch's are not (the writes wait on them)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from services.common import positions
from services.common.errors import FailedPrecondition
from services.generations import documents, logs
from services.generations.append import DeleteItem, TargetAppender, UpsertItem
from services.generations.context import RolloutContext
from services.generations.encoding import Embedder, embedding_text
from services.generations.held import enforce_bound, lag_and_added, lag_of
from services.generations.registry import Generation
from services.generations.target_replicas import replicas_ready
from services.index.changelog import target_vectors, text
from services.index.client import late_vectors
from services.index.keys import HOLD_LIFTED_KEY, GenerationKeys

log = logging.getLogger(__name__)


class ReplayBound:
    """The catch-up's replay rate at most ``factor`` times the source's write rate (the
    progress's last 10 s), and ``floor`` entries/s at least, so that it always gains on
    the writes: ``factor`` > 1, or ``floor`` above the write rate. Flat out (350 entries/s
    against 21 writes/s in ``bench.rollout``) its replay, the target's appends and its
    shards' adds took both cores for 8 s, the whole rollout's worst window for the
    searches (p99 269 ms against 69 ms in the bulk phase)."""

    def __init__(
        self,
        factor: float,
        floor: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.factor, self.floor = factor, floor
        self._clock, self._sleep = clock, sleep
        self._since = clock()

    def rate(self, write_rate: float) -> float:
        return max(self.floor, self.factor * write_rate)

    async def after(self, entries: int, write_rate: float) -> None:
        """Wait out what is left of the time ``entries`` take at :meth:`rate`, counted from
        the end of the previous wait (the replay's own time included)."""
        due = self._since + entries / self.rate(write_rate)
        now = self._clock()
        if due > now:
            await self._sleep(due - now)
        self._since = max(due, now)


# how long one report of a catch-up that does not gain lifts the local stack's pause of
# the rollout's processes (renewed at each report while it does not gain)
HOLD_LIFTED_S = 10


async def run_catch_up(ctx: RolloutContext) -> None:
    ctx.registry.set_state(ctx.state.target, "catching_up")
    factor = ctx.options.catch_up_factor
    bound = ReplayBound(factor, ctx.options.catch_up_floor) if factor else None
    while True:
        read = await replay(ctx, until=None, bound=bound)
        lag = lag_of(ctx)
        lag = read if lag is None else lag
        ctx.progress.lag(lag)
        if lag <= ctx.options.switch_lag:
            break
    # T's replicas apply their backlog here, while the budget still holds them (and pauses
    # them while searches run), not after the switch phase hands them to serving's CPUs
    await replicas_ready(ctx, ctx.target(), lambda: replay(ctx, until=None, bound=bound))
    ctx.save(phase="switch")


async def replay(
    ctx: RolloutContext, until: dict[int, str] | None, bound: ReplayBound | None = None
) -> int:
    """Replay S's logs from the saved positions: to their tails now (``until`` None: one
    pass), or to ``until`` exactly; the number of entries replayed. ``bound``: the
    catch-up's rate bound (the switch's replays run unbounded)."""
    target = ctx.target()
    src = ctx.keys(ctx.source())
    done = dict(ctx.state.positions)
    replayed = dict(ctx.state.replayed)
    appender = ctx.appender(target)
    embedder = ctx.embedder(target)
    count = 0
    for shard in range(src.num_shards):
        key = src.log(shard)
        end = until[shard] if until is not None else logs.last_id(ctx.client, key)
        position = done.get(shard, positions.ZERO)
        if logs.trimmed_past(ctx.client, key, position):
            raise FailedPrecondition(
                f"{key} was trimmed past {position} (the builder was gone longer than "
                "the shards' stale-replica time?): writes since cannot be replayed; "
                "abort the rollout and start again"
            )
        while positions.compare(position, end) < 0:
            entries = await asyncio.to_thread(
                ctx.client.xrange, key, f"({position}", end, ctx.options.batch
            )
            if not entries:
                break
            await _replay_entries(ctx, entries, src, shard, embedder, appender)  # type: ignore[arg-type]
            position = text(entries[-1][0])  # type: ignore[index, arg-type]
            done[shard] = position
            replayed[shard] = replayed.get(shard, 0) + len(entries)  # type: ignore[arg-type]
            count += len(entries)  # type: ignore[arg-type]
            ctx.save(positions=dict(done), replayed=dict(replayed))
            ctx.hold(src, {shard: position}, f"rollout:{target.name}")
            ctx.progress.advance(len(entries))  # type: ignore[arg-type]
            report(ctx, bounded=until is None)
            if bound is not None:
                await bound.after(len(entries), ctx.progress.write_rate)  # type: ignore[arg-type]
    return count


def report(ctx: RolloutContext, bounded: bool) -> None:
    """The lag and the write rate to the progress, a warning while the replay does not
    gain on the writes, and (``bounded``: not the switch's last replay, when the writes
    are paused) the bound on the entries held."""
    got = lag_and_added(ctx)
    if got is None:
        return
    ctx.progress.catch_up(*got)
    if ctx.progress.losing:  # no pause while searches run until it gains again
        ctx.client.set(HOLD_LIFTED_KEY, ctx.state.target, ex=HOLD_LIFTED_S)
    warning = ctx.progress.behind()
    if warning is not None:
        log.warning("%s", warning)
        ctx.progress.message(warning)
    if bounded:
        enforce_bound(ctx, got[0])


def reuses_logged_vectors(source: Generation, target: Generation) -> bool:
    """Whether T's vectors of S's log entries are the entries' own vectors: T's encoder is
    S's (``--retrain``, a shard-count change, a rollback between two generations of one
    encoder), by :meth:`EncoderSpec.identity`. Then the replay encodes nothing (no
    Triton call); otherwise each upsert is re-embedded with T's encoder."""
    return source.encoder.identity() == target.encoder.identity()


@dataclass
class _Entry:
    op: str
    ids: list[str]
    versions: list[int]
    rows: list[tuple[str, str]]
    metas: list[str]
    texts: list[str] | None
    vectors: np.ndarray | None = None  # T's vectors, when the entry carries them


def _parse_entry(fields: dict[bytes, bytes], logged: bool, identity: str) -> _Entry:
    """One of S's entries; with ``logged`` (T's encoder is S's) its vectors are T's, else
    the vectors the gateway's dual write logged by T's encoder (``identity``), if any."""
    ids = [str(i) for i in json.loads(fields[b"ids"])]
    if b"vers" in fields:
        versions = [int(v) for v in json.loads(fields[b"vers"])]
    else:
        versions = [int(fields.get(b"ver", b"0"))] * len(ids)
    if fields[b"op"] == b"d":
        return _Entry("d", ids, versions, [], [], [])
    titles = json.loads(fields[b"titles"]) if b"titles" in fields else None
    texts = json.loads(fields[b"texts"]) if b"texts" in fields else None
    tags = json.loads(fields.get(b"tags", b"null")) or [{}] * len(ids)
    rows = list(zip(titles or [""] * len(ids), texts or [""] * len(ids), strict=True))
    metas = [json.dumps(t, sort_keys=True) for t in tags]
    vectors: np.ndarray | None
    if logged:
        dim = int(fields[b"dim"])
        vectors = np.frombuffer(fields[b"vecs"], dtype="<f4").reshape(len(ids), dim)
    else:
        vectors = target_vectors(fields, identity)
    return _Entry("u", ids, versions, rows, metas, texts, vectors)


async def _replay_entries(
    ctx: RolloutContext,
    entries: list[Any],
    src: GenerationKeys,
    shard: int,
    embedder: Embedder,
    appender: TargetAppender,
) -> None:
    """Append a batch of S's entries (of ``shard``) in order: each upsert with the vectors
    the entry carries for T (its own: :func:`reuses_logged_vectors`; or the dual write's
    by T's encoder, logged or kept after the write), the others re-embedded together."""
    target = ctx.target()
    logged = reuses_logged_vectors(ctx.source(), target)
    identity = target.encoder.identity()
    parsed = [_parse_entry(fields, logged, identity) for _, fields in entries]
    if not logged:
        late = src.late_vectors(shard, target.name)
        await asyncio.to_thread(_late_rows, ctx.client, late, entries, parsed, target.encoder.dim)
    need: set[tuple[int, int]] = set()  # (entry, row) of the upserts whose text is missing
    for e, entry in enumerate(parsed):
        if entry.op == "u" and entry.texts is None:
            docs = dict(documents.read_docs(ctx.client, src, entry.ids))
            for n, doc_id in enumerate(entry.ids):
                d = docs.get(doc_id)
                if d is not None and int(d.get(b"ver", b"0")) == entry.versions[n]:
                    entry.rows[n] = (text(d.get(b"title", b"")), text(d.get(b"text", b"")))
                else:
                    need.add((e, n))  # a newer version follows in the log
    await _embed_missing(embedder, parsed)
    await asyncio.to_thread(_append_runs, appender, _runs(parsed, need))


def _late_rows(client: Any, key: str, entries: list[Any], parsed: list[_Entry], dim: int) -> None:
    """The rows of the upserts logged without T's vectors whose dual encode ended after
    the write (``key``: :mod:`services.index.client.late_vectors`), into ``parsed``."""
    todo = [e for e, entry in enumerate(parsed) if entry.op == "u" and entry.vectors is None]
    if not todo:
        return
    raw = client.hmget(key, [entries[e][0] for e in todo])
    for e, packed in zip(todo, raw, strict=True):
        parsed[e].vectors = late_vectors.unpack(packed, len(parsed[e].ids), dim)


@dataclass
class _Run:
    """Consecutive entries of one op, no id twice: one append."""

    op: str
    items: list[Any]


def _runs(parsed: list[_Entry], need: set[tuple[int, int]]) -> list[_Run]:
    """The items of ``parsed`` in order, in runs of one op without a repeated id: each
    run is one append (:data:`~services.generations.append.SCRIPT_ITEMS` items a script),
    not one script per entry. Writes are mostly single-document entries, and a script a
    document was the replay's cost: a round trip and an AOF write each, a third of the
    builder's time in a catch-up (py-spy, 2026-12-02; ``bench/catch_up_replay.py``). An id
    seen again, or the other op, starts a new run, so the target's log keeps the source's
    order for every document."""
    runs: list[_Run] = []
    ids: set[str] = set()
    for e, entry in enumerate(parsed):
        new: list[Any]
        if entry.op == "d":
            new = [DeleteItem(i, v) for i, v in zip(entry.ids, entry.versions, strict=True)]
        else:
            assert entry.vectors is not None
            new = [
                UpsertItem(doc, entry.versions[n], entry.vectors[n], *entry.rows[n], entry.metas[n])
                for n, doc in enumerate(entry.ids)
                if (e, n) not in need
            ]
        named = {item.doc_id for item in new}
        if not runs or runs[-1].op != entry.op or not ids.isdisjoint(named):
            runs.append(_Run(entry.op, []))
            ids = set()
        runs[-1].items += new
        ids |= named
    return [run for run in runs if run.items]


def _append_runs(appender: TargetAppender, runs: list[_Run]) -> None:
    for run in runs:
        if run.op == "d":
            appender.deletes(run.items)
        else:
            appender.upserts(run.items)


async def _embed_missing(embedder: Embedder, parsed: list[_Entry]) -> None:
    """Encode, in one call, the upserts of ``parsed`` that carry no vectors for T."""
    todo = [entry for entry in parsed if entry.op == "u" and entry.vectors is None]
    texts = [embedding_text(*row) for entry in todo for row in entry.rows]
    if not texts:
        return
    vectors = await embedder.embed(texts)
    k = 0
    for entry in todo:
        entry.vectors = vectors[k : k + len(entry.rows)]
        k += len(entry.rows)
