"""The gateway's core for documents: writes = encode (only what the model reads, see
:mod:`services.encoder.texts`) → store and log, in the serving index generation (encoded
again with the new generation's encoder and written there, within the deadline, when a
switch moves the writes meanwhile); reads by id.

No grpc here (see :mod:`services.gateway.pipeline`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from services.common.deadline import Deadline
from services.common.errors import DeadlineExceeded, GenerationMoved, NotFound, Unavailable
from services.common.limits import Limits
from services.encoder.texts import cut_for_encoder
from services.gateway import validation
from services.gateway.budget import DEFAULT_TIMEOUT_S, bounded
from services.gateway.domain import Document, WriteResult
from services.gateway.generations import Bundle, GenerationSource, Serving
from services.gateway.ports import DocRecord
from services.index.keys import CLOSED

# A write refused by its writer gate (a switch of the serving generation) is written again
# to the new serving generation after this pause, doubled per refusal up to the maximum,
# within the write's deadline (docs/generations.md: a switch pauses writes for its drain).
MOVED_BACKOFF_S = 0.01
MOVED_BACKOFF_MAX_S = 0.2
# time left, beyond the pause, below which a refused write is not tried again (nor less
# than twice its last attempt): the next attempt could not end before the deadline
MOVED_MARGIN_S = 0.05


def _not_taken(moved: GenerationMoved) -> Unavailable:
    return Unavailable(
        "the write was not taken within its deadline: the serving index generation is "
        f"switching ({moved.message}); nothing was written, write again"
    )


@dataclass
class DocumentPipeline:
    source: GenerationSource
    limits: Limits = field(default_factory=Limits)
    default_timeout_s: float = DEFAULT_TIMEOUT_S
    # called once per write refused by a moved writer gate (the gateway's counter)
    on_moved: Callable[[], None] = field(default=lambda: None)

    def _deadline(self, timeout: float | None) -> Deadline:
        return Deadline.after(self.default_timeout_s if timeout is None else timeout)

    async def upsert(self, docs: Sequence[Document], timeout: float | None) -> WriteResult:
        """Encode (only what the model reads, see :mod:`services.encoder.texts`), then
        store the whole documents and log them, in the serving generation (encoded again
        with the next one's encoder when a switch moves the writes meanwhile)."""
        deadline = self._deadline(timeout)
        validation.check_documents(docs, self.limits)
        cuts = [cut_for_encoder(d.embedding_text) for d in docs]
        texts = [text for text, _ in cuts]
        encoded: tuple[str, list[DocRecord], int] | None = None  # (encoder, records, cut)

        async def write(serving: Serving, parts: Bundle) -> WriteResult:
            nonlocal encoded
            if encoded is None or encoded[0] != parts.encoder_id:
                encoded = (
                    parts.encoder_id,
                    *await self._encode(parts, docs, texts, cuts, deadline),
                )
            _, records, truncated = encoded
            token = await bounded(parts.writer.upsert(records), deadline, "the write")
            return WriteResult(token, len(docs), truncated=truncated, origin=serving.origin)

        return await self._write(write, deadline)

    async def _encode(
        self,
        parts: Bundle,
        docs: Sequence[Document],
        texts: list[str],
        cuts: list[tuple[str, bool]],
        deadline: Deadline,
    ) -> tuple[list[DocRecord], int]:
        step = max(1, parts.encoder.max_batch)
        chunks = await asyncio.gather(
            *[
                parts.encoder.encode(texts[i : i + step], "document", timeout=deadline.remaining())
                for i in range(0, len(texts), step)
            ]
        )
        vectors = np.concatenate([c.vectors for c in chunks])
        flags = [t for c in chunks for t in c.truncated]
        truncated = sum(f or cut for f, (_, cut) in zip(flags, cuts, strict=True))
        records = [
            DocRecord(d.id, vectors[i], d.title, d.text, dict(d.metadata))
            for i, d in enumerate(docs)
        ]
        return records, truncated

    async def delete(self, ids: Sequence[str], timeout: float | None = None) -> WriteResult:
        deadline = self._deadline(timeout)
        validation.check_ids(ids, self.limits)

        async def write(serving: Serving, parts: Bundle) -> WriteResult:
            token, deleted, missing = await bounded(
                parts.writer.delete(ids), deadline, "the delete"
            )
            return WriteResult(token, len(deleted), not_found=tuple(missing), origin=serving.origin)

        return await self._write(write, deadline)

    async def _write(
        self, write: Callable[[Serving, Bundle], Awaitable[WriteResult]], deadline: Deadline
    ) -> WriteResult:
        """``write`` on the serving generation. When its writer gate refuses it
        (GenerationMoved: nothing written), the alias is read again and the write goes to
        the generation it names: at once when the gate names the new generation, after a
        pause while the gate is closed (a switch drains) or the alias has not moved yet
        (10 ms doubling to 200 ms). Unavailable when the deadline runs out first, or would
        before another attempt could end: an attempt cut by the deadline would be
        DEADLINE_EXCEEDED, which does not say that nothing was written."""
        serving = self.source.current()
        pause = MOVED_BACKOFF_S
        while True:
            started = time.monotonic()
            with self.source.lease(serving) as parts:
                try:
                    return await write(serving, parts)
                except GenerationMoved as exc:
                    moved = exc
            attempt_s = time.monotonic() - started
            self.on_moved()
            tried = serving.generation
            if moved.gate != CLOSED:  # the gate names the generation that takes writes now
                serving = await self._reread(moved, deadline)
            if moved.gate == CLOSED or serving.generation == tried:
                left = deadline.remaining()
                if left is not None and left <= pause + max(MOVED_MARGIN_S, 2 * attempt_s):
                    raise _not_taken(moved)
                await asyncio.sleep(pause)
                pause = min(2 * pause, MOVED_BACKOFF_MAX_S)
                serving = await self._reread(moved, deadline)

    async def _reread(self, moved: GenerationMoved, deadline: Deadline) -> Serving:
        try:
            return await bounded(self.source.refresh(), deadline, "reading the alias")
        except DeadlineExceeded:
            raise _not_taken(moved) from None

    async def get(self, doc_id: str, timeout: float | None = None) -> Document:
        deadline = self._deadline(timeout)
        validation.check_id(doc_id, self.limits)
        serving = self.source.current()
        with self.source.lease(serving) as parts:
            (doc,) = await bounded(parts.documents.get_many([doc_id]), deadline, "the read")
        if doc is None:
            raise NotFound(f"document {doc_id!r} does not exist")
        return doc
