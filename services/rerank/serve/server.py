"""Reranker process: load the checkpoint, serve RerankService."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from prometheus_client import CollectorRegistry

from retrieval.v1 import rerank_pb2, rerank_pb2_grpc
from services.common.errors import NotFound
from services.process.logs import configure_logging
from services.rerank.serve.metrics import RerankMetrics
from services.rerank.serve.pool import ScorerPool
from services.rerank.serve.scorer import CeliScorer
from services.rerank.serve.servicer import RerankServicer
from services.rerank.serve.settings import RerankSettings
from services.rpc import event_loop
from services.rpc.metrics import RpcMetrics
from services.rpc.server import Server, create_server, serve_started
from services.rpc.settings import load_settings
from services.telemetry import tracing

log = logging.getLogger(__name__)


@dataclass
class Reranker:
    """A running rerank server and its scorer."""

    server: Server
    port: int
    registry: CollectorRegistry
    scorer: CeliScorer  # the default model
    pool: ScorerPool  # it and the checkpoints of --checkpoint-dir

    async def close(self, grace: float = 1.0) -> None:
        await self.server.stop(grace)


def load_scorer(settings: RerankSettings, metrics: RerankMetrics | None = None) -> CeliScorer:
    import torch

    from services.rerank.checkpoint import load_or_default

    if settings.threads:
        torch.set_num_threads(settings.threads)
    path = Path(settings.checkpoint) if settings.checkpoint else None
    model, tokenizer, config = load_or_default(path)
    model = model.to(settings.device)
    name = f"{config.variant}:{config.backbone}" + ("" if config.trained else ":untrained")
    return CeliScorer(model, tokenizer, config, name, settings.batch_size, metrics)


def named_loader(
    settings: RerankSettings, metrics: RerankMetrics | None = None
) -> Callable[[Path, str], CeliScorer]:
    """Loads a checkpoint of ``--checkpoint-dir`` as the scorer named ``name:variant:backbone``."""

    def load(path: Path, name: str) -> CeliScorer:
        from services.rerank.checkpoint import load_checkpoint

        model, tokenizer, config = load_checkpoint(path)
        model = model.to(settings.device)
        label = f"{name}:{config.variant}:{config.backbone}"
        log.info("rerank checkpoint %s loaded from %s", name, path)
        return CeliScorer(model, tokenizer, config, label, settings.batch_size, metrics)

    return load


def load_pool(settings: RerankSettings, metrics: RerankMetrics | None = None) -> ScorerPool:
    """The default scorer, and the checkpoint directory's (loaded when named)."""
    root = Path(settings.checkpoint_dir) if settings.checkpoint_dir else None
    if root is not None and not root.is_dir():
        raise NotFound(f"--checkpoint-dir {root}: no such directory")
    default = load_scorer(settings, metrics)
    return ScorerPool(default, root, named_loader(settings, metrics), settings.max_loaded)


async def start_rerank(settings: RerankSettings) -> Reranker:
    registry = CollectorRegistry()
    pool = await asyncio.to_thread(load_pool, settings, RerankMetrics.create(registry))
    scorer = pool.default

    def register(server: grpc.aio.Server) -> Sequence[str]:
        rerank_pb2_grpc.add_RerankServiceServicer_to_server(RerankServicer(pool), server)
        return [rerank_pb2.DESCRIPTOR.services_by_name["RerankService"].full_name]

    server, port = await create_server(settings, register, RpcMetrics.create(registry, "rerank"))
    log.info(
        "rerank serving on %s:%d (model %s, batch %d%s)",
        settings.host,
        port,
        scorer.name,
        settings.batch_size,
        f"; checkpoints of {pool.root} by name" if pool.root is not None else "",
    )
    return Reranker(server, port, registry, scorer, pool)


async def serve(settings: RerankSettings) -> None:
    with tracing.traced(settings.tracing(), "gtr-rerank"):
        await serve_started(await start_rerank(settings), settings)


def main(argv: Sequence[str] | None = None) -> int:
    settings = load_settings(RerankSettings, list(argv or []), prog="gtr-retrieval rerank serve")
    configure_logging(settings.log_format, settings.log_level, service="rerank")
    event_loop.run(serve(settings), settings.event_loop, settings.loop_watch_ms)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
