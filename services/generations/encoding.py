"""Re-embedding documents for a rollout: the encoder's text, batching, retries.

A re-embedded document must get the vector the gateway would give it, so the text is the
encoder's own cut (:func:`services.encoder.texts.cut_for_encoder`, which the gateway uses
too). The builder is one process with nothing else to serve; its encodes go to a Triton
that also answers searches, so they are cut in batches of ``encode_batch`` (a search waits
behind one batch at most) with ``parallel`` in flight.
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
from services.generations.progress import Progress
from services.index.changelog import text

EncoderFactory = Callable[[EncoderSpec], Awaitable[Encoder]]


def embedding_text(title: str, body: str) -> str:
    """What the encoder reads of a document: the gateway's text and cut, so a re-embedded
    document gets the vector the gateway would give it."""
    return cut_for_encoder(f"{title} {body}" if title else body)[0]


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
    ) -> None:
        self.encoders = encoders
        self.spec = spec
        self.progress = progress
        self.encode_batch = encode_batch
        self.parallel = parallel
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self._encoder: Encoder | None = None

    async def _open(self) -> Encoder:
        if self._encoder is None:
            self._encoder = await self.encoders(self.spec)
        return self._encoder

    async def close(self) -> None:
        if self._encoder is not None:
            await self._encoder.close()
            self._encoder = None

    async def embed(self, texts: Sequence[str]) -> np.ndarray:
        """The vectors of ``texts`` (float32 rows, in order)."""
        encoder = await self._open()
        step = max(1, min(encoder.max_batch, self.encode_batch))
        sem = asyncio.Semaphore(max(1, self.parallel))

        async def one(chunk: Sequence[str]) -> np.ndarray:
            async with sem:
                out = await self._encode_retrying(encoder, list(chunk))
                return np.asarray(out.vectors, dtype=np.float32)

        parts = await asyncio.gather(
            *(one(texts[i : i + step]) for i in range(0, len(texts), step))
        )
        return np.concatenate(parts) if parts else np.zeros((0, encoder.dim), np.float32)

    async def _encode_retrying(self, encoder: Encoder, texts: list[str]) -> Any:
        """``encoder.encode``, retried while the encoder is unavailable, overloaded, slow or
        failing inside (a Triton restarting, a model stub replaced) for up to ``retry_s``
        with backoff 0.5 s doubling to 10 s: a rollout of hours does not die of a minute's
        outage. Bad input is not retried."""
        deadline = time.monotonic() + self.retry_s
        backoff = 0.5
        while True:
            try:
                return await encoder.encode(texts, "document", timeout=self.timeout_s)
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
