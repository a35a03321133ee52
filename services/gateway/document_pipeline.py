"""The gateway's core for documents: writes = encode (only what the model reads, see
:mod:`services.encoder.texts`) → store and log, in the serving index generation (encoded
again with the new generation's encoder and written there, within the deadline, when a
switch moves the writes meanwhile; during a rollout to another encoder, encoded with that
one too and logged beside: :mod:`services.gateway.dual_write`); reads by id.

No grpc here (see :mod:`services.gateway.pipeline`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from services.common.deadline import Deadline
from services.common.domain import WriteToken
from services.common.errors import (
    DeadlineExceeded,
    GenerationMoved,
    NotFound,
    RetrievalError,
    Unavailable,
)
from services.common.limits import Limits
from services.common.parking import parked
from services.encoder.texts import cut_for_encoder
from services.gateway import validation
from services.gateway.budget import DEFAULT_TIMEOUT_S, bounded
from services.gateway.domain import Document, WriteResult
from services.gateway.dual_write import (
    DUAL_ENCODE_TIMEOUT_S,
    LATE_ENCODE_S,
    MAX_LATE,
    DualTarget,
)
from services.gateway.generation_parts import Bundle, Serving
from services.gateway.generations import GenerationSource
from services.gateway.ports import DocRecord, Encoder, TargetVectors
from services.gateway.write_trail import step, trail
from services.index.keys import CLOSED
from services.telemetry import tracing

log = logging.getLogger(__name__)

# A write refused by its writer gate (a switch of the serving generation) is written again
# to the new serving generation after this pause, doubled per refusal up to the maximum,
# within the write's deadline (docs/generations.md: a switch pauses writes for its drain).
MOVED_BACKOFF_S = 0.01
MOVED_BACKOFF_MAX_S = 0.2
# time left, beyond the pause, below which a refused write is not tried again (nor less
# than twice its last attempt): the next attempt could not end before the deadline
MOVED_MARGIN_S = 0.05
# ... nor less than this share of the time the write had left when it reached the store
# (the encode done; at most MOVED_RESERVE_MAX_S):
# the UNAVAILABLE must reach the client before its own deadline, on a loaded machine too,
# where a pause or an alias re-read can run tens of milliseconds long (a 2-s write's
# answer arrived after the client's deadline once, in a test beside another worker)
MOVED_RESERVE_SHARE = 0.1
MOVED_RESERVE_MAX_S = 0.5


def _not_taken(moved: GenerationMoved) -> Unavailable:
    return Unavailable(
        "the write was not taken within its deadline: the serving index generation is "
        f"switching ({moved.message}); nothing was written, write again"
    )


@dataclass(eq=False)
class _SecondEncode:
    """A write's dual encode: its task, when it began, whether the write went on without
    it (:meth:`DocumentPipeline._await_dual`)."""

    task: asyncio.Task[tuple[np.ndarray, int]]
    started: float
    pending: bool = False


@dataclass
class DocumentPipeline:
    source: GenerationSource
    limits: Limits = field(default_factory=Limits)
    default_timeout_s: float = DEFAULT_TIMEOUT_S
    # called once per write refused by a moved writer gate (the gateway's counter)
    on_moved: Callable[[], None] = field(default=lambda: None)
    # called once per dual encode (services/gateway/dual_write.py): "encoded" | "failed"
    on_dual: Callable[[str], None] = field(default=lambda outcome: None)

    def _deadline(self, timeout: float | None) -> Deadline:
        return Deadline.after(self.default_timeout_s if timeout is None else timeout)

    async def upsert(self, docs: Sequence[Document], timeout: float | None) -> WriteResult:
        """Encode (only what the model reads, see :mod:`services.encoder.texts`), then
        store the whole documents and log them, in the serving generation (encoded again
        with the next one's encoder when a switch moves the writes meanwhile). While a
        rollout to another encoder runs, the rollout target's vectors are logged beside
        (:mod:`services.gateway.dual_write`)."""
        deadline = self._deadline(timeout)
        validation.check_documents(docs, self.limits)
        cuts = [cut_for_encoder(d.embedding_text) for d in docs]
        texts = [text for text, _ in cuts]
        # (vectors, truncated) by the encoder of the generation written to
        # (encoder_identity), and by a rollout target's, by its name (None: failed)
        own: dict[str, tuple[np.ndarray, int]] = {}
        dual_done: dict[str, tuple[np.ndarray, int] | None] = {}

        async def write(serving: Serving, parts: Bundle) -> WriteResult:
            dual = self.source.dual.current(serving.generation)
            # a write moved by a switch into the target its dual write encoded for
            # takes those vectors (the same generation's encoder)
            mine = dual_done.get(serving.generation)
            encode_own = mine is None and parts.encoder_id not in own
            second = None
            if dual is not None and dual.target not in dual_done:
                second = self._start_dual(dual, texts, cuts)
            jobs = ["own"] * encode_own + ["dual"] * (second is not None)
            try:
                with tracing.span("encode") as span, step(f"encode {'+'.join(jobs)}", bool(jobs)):
                    if span:
                        span.set_attribute("gtr.documents", len(texts))
                    if encode_own:
                        own[parts.encoder_id] = await self._encode(
                            parts.encoder, texts, cuts, deadline
                        )
                    theirs = await self._await_dual(second, deadline)
                if dual is not None and second is not None:
                    dual_done[dual.target] = theirs
                vectors, truncated = mine or own[parts.encoder_id]
                records = [
                    DocRecord(d.id, vectors[i], d.title, d.text, dict(d.metadata))
                    for i, d in enumerate(docs)
                ]
                target = TargetVectors(dual.identity, theirs[0]) if dual and theirs else None
                with step("store"):
                    token = await bounded(
                        parts.writer.upsert(records, target), deadline, "the write"
                    )
            except BaseException:
                if second is not None:
                    second.task.cancel()  # nothing logged: nothing to keep its rows for
                raise
            if dual is not None and second is not None and theirs is None and second.pending:
                self._keep_late(second, parts, token, [d.id for d in docs], dual.target)
            return WriteResult(token, len(docs), truncated=truncated, origin=serving.origin)

        with trail(f"upsert of {len(docs)}"):
            return await self._write(write, deadline)

    async def _encode(
        self,
        encoder: Encoder,
        texts: list[str],
        cuts: list[tuple[str, bool]],
        deadline: Deadline,
    ) -> tuple[np.ndarray, int]:
        """(the vectors of ``texts``, how many were truncated)."""
        step = max(1, encoder.max_batch)
        chunks = await asyncio.gather(
            *[
                encoder.encode(texts[i : i + step], "document", timeout=deadline.remaining())
                for i in range(0, len(texts), step)
            ]
        )
        vectors = np.concatenate([c.vectors for c in chunks])
        flags = [t for c in chunks for t in c.truncated]
        truncated = sum(f or cut for f, (_, cut) in zip(flags, cuts, strict=True))
        return vectors, truncated

    def _start_dual(
        self, dual: DualTarget, texts: list[str], cuts: list[tuple[str, bool]]
    ) -> _SecondEncode:
        """:meth:`_encode` with a rollout target's encoder, started beside the write's own
        and bounded by :data:`~services.gateway.dual_write.LATE_ENCODE_S`, not by the
        write's deadline: a late one is kept after the write (:meth:`_keep_late`)."""
        late = Deadline.after(LATE_ENCODE_S)
        task = self.source.dual.start(dual, lambda e: self._encode(e, texts, cuts, late))
        return _SecondEncode(task, time.monotonic())

    async def _await_dual(
        self, second: _SecondEncode | None, deadline: Deadline
    ) -> tuple[np.ndarray, int] | None:
        """``second``'s vectors when it ends within
        :data:`~services.gateway.dual_write.DUAL_ENCODE_TIMEOUT_S` of its start (and the
        write's deadline); None (counted, logged: the write goes on without) when it failed
        or is still running (``second.pending``; cancelled, "failed", when
        :data:`~services.gateway.dual_write.MAX_LATE` are late already)."""
        if second is None:
            return None
        left = deadline.remaining()
        bound = DUAL_ENCODE_TIMEOUT_S - (time.monotonic() - second.started)
        limit = max(0.0, bound if left is None else min(bound, left))
        done, _ = await asyncio.wait({second.task}, timeout=limit)
        if not done and not self.source.dual.late_full():
            second.pending = True
            return None
        if not done:  # MAX_LATE wait already: this one is not kept
            second.task.cancel()
            self.on_dual("failed")
            log.info("dual write: the rollout target's encode is late, and so are %d", MAX_LATE)
            return None
        try:
            out = second.task.result()
        except (RetrievalError, TimeoutError, asyncio.CancelledError) as exc:
            # (cancelled: its client closed under it, e.g. a gateway closing)
            self.on_dual("failed")
            log.info(
                "dual write: the rollout target's encode failed (%s: %s); logged without",
                type(exc).__name__,
                exc,
            )
            return None
        self.on_dual("encoded")
        return out

    def _keep_late(
        self, second: _SecondEncode, parts: Bundle, token: WriteToken, ids: list[str], target: str
    ) -> None:
        """Once ``second`` ends, its rows kept beside the log entries ``token`` names, for
        ``target``'s catch-up (counted "late"; "failed" when it fails after all)."""
        writer = parts.writer

        async def keep(out: tuple[np.ndarray, int]) -> None:
            await writer.keep_late_vectors(token, ids, target, out[0])

        self.source.dual.keep_late(second.task, keep, self.on_dual)

    async def delete(self, ids: Sequence[str], timeout: float | None = None) -> WriteResult:
        deadline = self._deadline(timeout)
        validation.check_ids(ids, self.limits)

        async def write(serving: Serving, parts: Bundle) -> WriteResult:
            token, deleted, missing = await bounded(
                parts.writer.delete(ids), deadline, "the delete"
            )
            return WriteResult(token, len(deleted), not_found=tuple(missing), origin=serving.origin)

        with trail(f"delete of {len(ids)}"):
            return await self._write(write, deadline)

    async def _write(
        self, write: Callable[[Serving, Bundle], Awaitable[WriteResult]], deadline: Deadline
    ) -> WriteResult:
        """``write`` on the serving generation. When its writer gate refuses it
        (GenerationMoved: nothing written), the alias is read again and the write goes to
        the generation it names: at once when the gate names the new generation, after a
        pause while the gate is closed (a switch drains) or the alias has not moved yet
        (10 ms doubling to 200 ms). Unavailable when the deadline runs out first, or would
        before another attempt could end with a reserve for the answer (a tenth of the
        time left when the write reached the store, 50 ms to 0.5 s): an attempt cut by
        the deadline would be DEADLINE_EXCEEDED, which does not say that nothing was
        written. A pause lends the call's admission units back (:mod:`services.common.parking`):
        the writes a switch pauses do not take the searches' room."""
        serving = self.source.current()
        pause = MOVED_BACKOFF_S
        budget = deadline.remaining()
        reserve = (
            MOVED_MARGIN_S
            if budget is None
            else max(MOVED_MARGIN_S, min(MOVED_RESERVE_SHARE * budget, MOVED_RESERVE_MAX_S))
        )
        while True:
            started = time.monotonic()
            with self.source.lease(serving) as parts, step(f"attempt on {serving.generation}"):
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
                if left is not None and left <= pause + max(reserve, 2 * attempt_s):
                    raise _not_taken(moved)
                with step("pause"), parked():  # its admission units lent back meanwhile
                    await asyncio.sleep(pause)
                pause = min(2 * pause, MOVED_BACKOFF_MAX_S)
                serving = await self._reread(moved, deadline)

    async def _reread(self, moved: GenerationMoved, deadline: Deadline) -> Serving:
        try:
            with step("alias re-read"):
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
