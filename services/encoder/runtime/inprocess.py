"""The encoder running in this process (embedded mode, tests, benchmarks).

The model call is CPU-bound and releases the GIL inside PyTorch / ONNX Runtime, so it
runs in a small thread pool: the event loop keeps serving other requests. A timeout
stops *waiting* (DeadlineExceeded); the thread finishes its batch in the background,
which is the same thing a server does with a cancelled request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from services.common import timeouts
from services.common.errors import DeadlineExceeded
from services.encoder.base import Embedder, Embeddings, Encoder, validate_request
from services.encoder.profiles import Kind


class InProcessEncoder(Encoder):
    """:class:`Encoder` over a local :class:`Embedder` (PyTorch or ONNX Runtime)."""

    def __init__(self, embedder: Embedder, max_batch: int | None = None, workers: int = 1) -> None:
        self.embedder = embedder
        self.model_name = embedder.model_name
        self.dim = embedder.dim
        self.max_batch = max_batch or embedder.profile.max_batch
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="encoder")

    @classmethod
    def torch(cls, model_dir: Path | None = None, threads: int | None = None) -> InProcessEncoder:
        """The PyTorch model from a sentence-transformers folder (default: all-MiniLM-L6-v2)."""
        from services.encoder.model import TorchEmbedder

        return cls(TorchEmbedder(model_dir, threads=threads))

    @classmethod
    def onnx(cls, onnx_path: Path, threads: int | None = None) -> InProcessEncoder:
        """The ONNX export (``encoder export``) with ONNX Runtime."""
        from services.encoder.runtime.onnx_embedder import OnnxEmbedder

        return cls(OnnxEmbedder(onnx_path, threads=threads))

    async def encode(
        self, texts: Sequence[str], kind: Kind, timeout: float | None = None
    ) -> Embeddings:
        items = validate_request(texts, kind, self.max_batch)
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._pool, self.embedder.embed, items, kind)
        try:
            vectors, truncated = await timeouts.wait_for(future, timeout)
        except TimeoutError:
            raise DeadlineExceeded(
                f"encoding {len(items)} texts took longer than {timeout:.3f} s"
            ) from None
        return Embeddings(vectors, truncated)

    async def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
