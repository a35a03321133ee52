"""A tiny CELI checkpoint for tests that need a real rerank service: a BERT backbone of a
few words built in the test, the CELI head on it, saved as the trainer saves; and a real
rerank server on it, served from an event loop of its own in a background thread. For the
scorer's own tests, a tiny scorer without a server (``tiny_scorer``)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.rerank.serve.metrics import RerankMetrics
    from services.rerank.serve.scorer import CeliScorer
    from services.rerank.serve.server import Reranker

# The stdlib-like words the gateway's rerank tests search with.
WORDS = ["file", "read", "json", "csv", "thread", "pool", "hash", "bytes", "list", "row"]
# The words of the scorer tests' backbone (tiny_scorer).
GREEK = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]


def tiny_scorer(base: Path, metrics: RerankMetrics | None = None) -> CeliScorer:
    """A CELI scorer (no server) named "tiny" on an untrained backbone of :data:`GREEK`
    written under ``base``: pairs of 32 tokens, queries of 8, 4-d token vectors, batches
    of 3 (so a handful of texts spans several)."""
    from services.rerank.checkpoint import CeliConfig, build_model
    from services.rerank.serve.scorer import CeliScorer
    from services.rerank.tiny import write_tiny_backbone

    path = write_tiny_backbone(base / "bert", GREEK, seed=5)
    cfg = CeliConfig(max_len=32, max_query_len=8, d_tok=4)
    model, tok = build_model(path, cfg, seed=2)
    return CeliScorer(model, tok, cfg, "tiny", batch_size=3, metrics=metrics)


def tiny_checkpoint(
    base: Path, words: Sequence[str] = WORDS, seed: int = 9, name: str = "ckpt"
) -> Path:
    """``base/name``: a CELI head (initialised with ``seed``: another seed, other scores)
    on a tiny backbone of ``words``, saved as the trainer saves."""
    from services.rerank.checkpoint import CeliConfig, build_model, save_checkpoint
    from services.rerank.tiny import write_tiny_backbone

    cfg = CeliConfig(max_len=48, max_query_len=8, d_tok=4)
    backbone = write_tiny_backbone(base / f"bert-{name}", list(words), seed=4)
    model, tok = build_model(backbone, cfg, seed=seed)
    return save_checkpoint(model, tok, cfg, base / name)


@contextmanager
def rerank_in_background(base: Path, **settings: object) -> Iterator[Reranker]:
    """A real rerank server (port 0: a free one) on a tiny checkpoint built under ``base``,
    on its own event loop in a daemon thread, so synchronous tests and a gateway running
    in another thread can call it; closed (and the loop stopped) on exit. ``settings``:
    more of its RerankSettings (``checkpoint_dir``, ``max_loaded``)."""
    from services.rerank.serve.server import start_rerank
    from services.rerank.serve.settings import RerankSettings

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="rerank", daemon=True)
    thread.start()
    config = RerankSettings(
        port=0,
        checkpoint=str(tiny_checkpoint(base / "celi")),
        **settings,  # type: ignore[arg-type]
    )
    try:
        reranker = asyncio.run_coroutine_threadsafe(start_rerank(config), loop).result(300)
        try:
            yield reranker
        finally:
            asyncio.run_coroutine_threadsafe(reranker.close(0), loop).result(60)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()
