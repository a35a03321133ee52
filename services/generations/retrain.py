"""A retrain's sample: every vector the source's replicas hold (``ExportVectors``, once each
has applied P0), appended to the target as version 0, and a reservoir sample of them for
the training (the encoder is the same, so nothing is re-embedded). Each chunk's reads and
appends are paced on the searches' p99 as a re-embedding's encode calls are
(:mod:`services.generations.pacing`): on a large corpus they are the train phase's work."""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass, field

import numpy as np

from services.common import positions
from services.common.errors import Unavailable
from services.generations import documents
from services.generations.append import RETRAIN_VERSION, TargetAppender, UpsertItem
from services.generations.context import Exporter, RolloutContext
from services.generations.errors import SourceAddressesUnknown
from services.generations.registry import Generation
from services.generations.replicas import parse_addresses
from services.index.changelog import text
from services.index.keys import GenerationKeys


class _Behind(Exception):
    pass


@dataclass
class _Reservoir:
    """A uniform sample of at most ``size`` vectors of a stream (seeded: reproducible)."""

    size: int
    rows: list[np.ndarray] = field(default_factory=list)
    seen: int = 0
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(1234))

    def offer(self, vector: np.ndarray) -> None:
        self.seen += 1
        if len(self.rows) < self.size:
            self.rows.append(np.asarray(vector, np.float32))
            return
        j = int(self.rng.integers(0, self.seen))
        if j < self.size:
            self.rows[j] = np.asarray(vector, np.float32)


async def export_all(ctx: RolloutContext, target: Generation) -> np.ndarray:
    """Append every vector S's replicas hold (version 0) and return a reservoir sample."""
    exporter: Exporter
    if ctx.wiring.exporter is None:
        from services.index.client.export import export_vectors

        exporter = functools.partial(export_vectors, tls=ctx.wiring.shard_tls)
    else:
        exporter = ctx.wiring.exporter
    source = ctx.source()
    spec = ctx.registry.addresses(source.name) or ctx.wiring.source_addresses
    if not spec:
        raise SourceAddressesUnknown(
            f"a retrain reuses {source.name}'s vectors, but its shard addresses are unknown "
            "({gtr}:addrs has none)"
        )
    src = ctx.keys(source)
    appender = ctx.appender(target)
    sample = _Reservoir(ctx.options.sample)
    ctx.progress.total(documents.count(ctx.client, src))
    for shard, replicas in enumerate(parse_addresses(spec)):
        await _export_shard(ctx, exporter, replicas, shard, src, appender, sample)
    dim = target.encoder.dim or (sample.rows[0].shape[0] if sample.rows else 0)
    return np.stack(sample.rows) if sample.rows else np.zeros((0, dim), np.float32)


async def _export_shard(
    ctx: RolloutContext,
    exporter: Exporter,
    replicas: list[str],
    shard: int,
    src: GenerationKeys,
    appender: TargetAppender,
    sample: _Reservoir,
) -> None:
    """One shard's vectors from the first replica that has applied P0 (retried until
    ``shard_wait_s``)."""
    p0 = ctx.state.p0[shard]
    deadline = time.monotonic() + ctx.options.shard_wait_s
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        for address in replicas:
            seen = sample.seen
            try:
                async for ids, vectors, position in exporter(address):
                    if not positions.at_least(position or positions.ZERO, p0):
                        raise _Behind(f"{address} applied {position}, P0 is {p0}")
                    await _append(ctx, src, appender, sample, ids, vectors)
                return
            except _Behind as exc:
                last_error = exc
            except (Unavailable, OSError) as exc:
                last_error = exc
                await ctx.check_transport(address)
            sample.seen = seen  # what this replica gave is given again by the next
        await asyncio.sleep(0.5)
    hint = ""
    tls = ctx.wiring.shard_tls
    if tls is not None and not tls.cert:
        hint = ": if the replicas require client certificates (mTLS, as under `up --tls`), "
        hint += "give the rollout a client certificate and key"
    raise Unavailable(
        f"retrain: no replica of {src.name}'s shard {shard} exported its vectors at or "
        f"past P0 within {ctx.options.shard_wait_s:.0f} s ({last_error}){hint}"
    )


async def _append(
    ctx: RolloutContext,
    src: GenerationKeys,
    appender: TargetAppender,
    sample: _Reservoir,
    ids: list[str],
    vectors: np.ndarray,
) -> None:
    began = time.monotonic()
    docs = dict(await asyncio.to_thread(documents.read_docs, ctx.client, src, ids))
    items = []
    for n, doc_id in enumerate(ids):
        d = docs.get(doc_id)
        if d is None:
            continue  # deleted since: the replay appends the delete
        items.append(
            UpsertItem(
                doc_id,
                RETRAIN_VERSION,
                vectors[n],
                text(d.get(b"title", b"")),
                text(d.get(b"text", b"")),
                text(d.get(b"meta", b"{}")),
            )
        )
        sample.offer(vectors[n])
    await asyncio.to_thread(appender.upserts, items)  # short scripts: append.SCRIPT_ITEMS
    ctx.progress.advance(len(ids))
    if ctx.pacer is not None:  # paced as the re-embedding's encode calls are
        await ctx.pacer.after_call(time.monotonic() - began)
