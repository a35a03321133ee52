"""Re-embedding documents for a rollout: the encoder's text, batching, retries.

A re-embedded document must get the vector the gateway would give it, so the text is the
encoder's own cut (:func:`services.encoder.texts.cut_for_encoder`, which the gateway uses
too). The builder is one process with nothing else to serve; its encodes go to a Triton
version that also takes the gateways' dual encodes of new writes (docs/generations.md
"the dual write"), in Triton's arrival order. So each call is cut by *time*, not only by
count: at most ``encode_batch`` texts, and as many as the encoder got through in
``call_s`` seconds lately (:class:`ChunkSize`); and the calls in flight, over all its
batches, are as many as fit in ``call_s`` together (at least 1, at most ``parallel``):
one when the calls are cut by time (a CPU encoder), two when they are cut by count and
short (a GPU). That is meant to keep a dual encode's wait near ``call_s``, inside its
1-s bound (``DUAL_ENCODE_TIMEOUT_S``). Measured (docs/generations.md, bench.rollout at
20 writes/s on 2 CPUs): with chunks of 16 long documents (~1.4 s each on one CPU) two
thirds of the dual encodes timed out and the catch-up encoded those writes a second
time; cut by time with 2 calls in flight a quarter still did; with 1 in flight, a tenth.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from services.common.encoder_spec import EncoderSpec
from services.common.errors import FailedPrecondition, InvalidArgument, NotFound, RetrievalError
from services.encoder.base import Encoder
from services.encoder.texts import cut_for_encoder
from services.generations.append import TargetAppender, UpsertItem
from services.generations.documents import Doc
from services.generations.pacing import Pacer
from services.generations.progress import Progress
from services.index.changelog import text

EncoderFactory = Callable[[EncoderSpec], Awaitable[Encoder]]


def embedding_text(title: str, body: str) -> str:
    """What the encoder reads of a document: the gateway's text and cut, so a re-embedded
    document gets the vector the gateway would give it."""
    return cut_for_encoder(f"{title} {body}" if title else body)[0]


class ChunkSize:
    """How many texts the next encode call carries: as many as took ``call_s`` seconds
    lately (a moving average of the seconds per text of the calls so far, their wait in
    Triton's queue included), between 1 and ``most``. The first call carries
    ``first`` texts: a probe, before anything is known of this encoder's pace."""

    SMOOTHING = 0.3  # weight of the newest call in the average

    def __init__(self, most: int, call_s: float, first: int = 2) -> None:
        self.most = max(1, most)
        self.call_s = call_s
        self.first = max(1, min(first, self.most))
        self.per_text_s: float | None = None
        self.per_call_s: float | None = None  # the same average, of a whole call

    def in_flight(self, most: int) -> int:
        """How many calls may be in flight together: as many as take ``call_s`` (a dual
        encode queued behind them waits about that), at least 1, at most ``most``; 1
        until a call has been timed."""
        if self.per_call_s is None:
            return 1
        return max(1, min(most, int(self.call_s / max(self.per_call_s, 1e-9))))

    def next(self) -> int:
        if self.per_text_s is None:
            return self.first
        return max(1, min(self.most, int(self.call_s / self.per_text_s)))

    def observe(self, texts: int, seconds: float) -> None:
        if texts <= 0:
            return
        self.per_text_s = self._averaged(self.per_text_s, seconds / texts)
        self.per_call_s = self._averaged(self.per_call_s, seconds)

    def _averaged(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.SMOOTHING * (new - old)


class Embedder:
    """The target generation's encoder, opened on first use, with batching and retries."""

    def __init__(
        self,
        encoders: EncoderFactory,
        spec: EncoderSpec,
        progress: Progress,
        *,
        encode_batch: int,
        parallel: int,
        timeout_s: float,
        retry_s: float,
        call_s: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
        pacer: Pacer | None = None,
    ) -> None:
        self.encoders = encoders
        self.spec = spec
        self.progress = progress
        self.encode_batch = encode_batch
        self.parallel = parallel
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.call_s = call_s
        self.clock = clock
        self.pacer = pacer  # pauses after each call (services/generations/pacing.py)
        self._encoder: Encoder | None = None
        self._chunks: ChunkSize | None = None  # kept across batches: the pace learnt
        # the calls in flight, over every batch being embedded at once (the bulk phase
        # keeps `parallel` batches in flight): each batch with calls of its own put up to
        # parallel² calls ahead of a dual encode
        self._running: set[asyncio.Future[np.ndarray]] = set()

    async def _open(self) -> Encoder:
        if self._encoder is None:
            self._encoder = await self.encoders(self.spec)
        return self._encoder

    async def close(self) -> None:
        if self._encoder is not None:
            await self._encoder.close()
            self._encoder = None

    async def embed(self, texts: Sequence[str]) -> np.ndarray:
        """The vectors of ``texts`` (float32 rows, in order): calls of :class:`ChunkSize`
        texts, as many in flight over every batch this embedder is embedding at once as
        :meth:`ChunkSize.in_flight` allows (at most ``parallel``), each sized when it is
        sent (so the pace the calls before it measured applies)."""
        encoder = await self._open()
        if self._chunks is None:
            self._chunks = ChunkSize(min(encoder.max_batch, self.encode_batch), self.call_s)
        chunks = self._chunks

        async def one(chunk: list[str]) -> np.ndarray:
            out, took = await self._encode_retrying(encoder, chunk)
            chunks.observe(len(chunk), took)
            if self.pacer is not None:  # its pause keeps this call's place in flight
                await self.pacer.after_call(took)
            return np.asarray(out.vectors, dtype=np.float32)

        calls: list[asyncio.Task[np.ndarray]] = []
        try:
            at = 0
            while at < len(texts):
                while len(self._running) >= chunks.in_flight(self.parallel):
                    await asyncio.wait(self._running, return_when=asyncio.FIRST_COMPLETED)
                if any(c.done() and not c.cancelled() and c.exception() for c in calls):
                    break  # gather below raises it
                step = chunks.next()
                call = asyncio.ensure_future(one(list(texts[at : at + step])))
                self._running.add(call)
                call.add_done_callback(self._running.discard)
                calls.append(call)
                at += step
            parts = await asyncio.gather(*calls)
        except BaseException:
            for call in calls:
                call.cancel()
            raise
        return np.concatenate(parts) if parts else np.zeros((0, encoder.dim), np.float32)

    async def _encode_retrying(self, encoder: Encoder, texts: list[str]) -> tuple[Any, float]:
        """``encoder.encode``, retried while the encoder is unavailable, overloaded, slow or
        failing inside (a Triton restarting, a model stub replaced) for up to ``retry_s``
        with backoff 0.5 s doubling to 10 s: a rollout of hours does not die of a minute's
        outage. Bad input is not retried. With the answer, the seconds of the attempt that
        gave it: what the call size and the pacer learn from. The outage before it is not
        the encoder's pace (counted, a minute's outage paused the bulk for nine at the
        pacer's lowest duty, and cut its calls to one text)."""
        deadline = time.monotonic() + self.retry_s
        backoff = 0.5
        while True:
            start = self.clock()
            try:
                out = await encoder.encode(texts, "document", timeout=self.timeout_s)
                return out, self.clock() - start
            except (InvalidArgument, NotFound, FailedPrecondition):
                raise
            except RetrievalError as exc:
                if time.monotonic() + backoff > deadline:
                    raise
                self.progress.message(f"encoder: {exc}; again in {backoff:.1f} s")
                await asyncio.sleep(backoff)
                backoff = min(10.0, backoff * 2)


async def append_documents(
    embedder: Embedder, appender: TargetAppender, batch: list[Doc], dim: int
) -> np.ndarray:
    """Encode and append SCANned documents; their vectors."""
    if not batch:
        return np.zeros((0, dim or 1), np.float32)
    texts = [
        embedding_text(text(d.get(b"title", b"")), text(d.get(b"text", b""))) for _, d in batch
    ]
    vectors = await embedder.embed(texts)
    items = [
        UpsertItem(
            doc_id,
            int(d.get(b"ver", b"0")),
            vectors[n],
            text(d.get(b"title", b"")),
            text(d.get(b"text", b"")),
            text(d.get(b"meta", b"{}")),
        )
        for n, (doc_id, d) in enumerate(batch)
    ]
    await asyncio.to_thread(appender.upserts, items)
    return vectors
