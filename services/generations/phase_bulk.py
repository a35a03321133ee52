"""The ``bulk`` phase (new encoder): the rest of the SCAN of the source's documents,
re-embedded and appended, the cursor saved after every batch. A document written after
P0 is left to the catch-up, which replays its log entry (:func:`documents.written_since`):
the bulk is bounded by what was stored at P0, whatever the write rate or its own pace."""

from __future__ import annotations

import asyncio
from collections import deque

import numpy as np

from services.generations import documents
from services.generations.context import RolloutContext
from services.generations.encoding import append_documents
from services.generations.held import enforce_bound, lag_of
from services.generations.state import ScanCursor


async def run_bulk(ctx: RolloutContext) -> None:
    """Up to ``parallel`` batches in flight: the next SCAN and document reads overlap the
    encoding of the ones before (Triton is not left idle while Redis answers). The cursor
    saved is the one after the oldest batch finished with every batch before it: a crash
    re-runs at most the batches in flight (appends are idempotent)."""
    target = ctx.target()
    src = ctx.keys(ctx.source())
    cursor, done = ctx.state.cursor, ctx.state.done
    total = ctx.state.total or documents.count(ctx.client, src)
    ctx.progress.total(total, done)
    embedder, appender = ctx.embedder(target), ctx.appender(target)
    pending: deque[tuple[ScanCursor, int, asyncio.Task[np.ndarray]]] = deque()
    left = 0  # documents written since P0, left to the catch-up

    async def finish_oldest() -> None:
        nonlocal done
        after, n, task = pending.popleft()
        await task
        done += n
        ctx.progress.advance(n)
        ctx.save(cursor=after, done=done)
        enforce_bound(ctx, lag_of(ctx))  # S's logs held meanwhile

    try:
        if not cursor.finished:
            async for batch, after in documents.scan(ctx.client, src, cursor, ctx.options.batch):
                late = {i for i, _ in documents.written_since(batch, src, ctx.state.p0)}
                if late:
                    left += len(late)
                    batch = [d for d in batch if d[0] not in late]
                task = asyncio.create_task(
                    append_documents(embedder, appender, batch, target.encoder.dim)
                )
                pending.append((after, len(batch) + len(late), task))
                while len(pending) >= max(1, ctx.options.parallel) or (
                    pending and pending[0][2].done()
                ):
                    await finish_oldest()
            while pending:
                await finish_oldest()
    finally:
        for _, _, task in pending:
            task.cancel()
    if left:
        ctx.progress.message(
            f"bulk: {left} documents written since P0 left to the catch-up (their log entries)"
        )
    ctx.registry.set_state(target.name, "catching_up")
    ctx.save(phase="catch_up")
