"""The evaluation through a running gateway: what a client of the service gets.

The corpus is upserted first (``ingest``; the same documents again are a no-op for the
index), then every query is one ``Search`` (k = 100, ``ids_only``, STRONG consistency so
the ingest is visible), at the server's default nprobe and at the nprobe values asked
for; with ``rerank`` the gateway also reranks (its CELI, ``rerank_depth``) the held-out
queries, as in the in-process path. The client is the SDK's (``gtr_client``); errors are
its exceptions (the gateway's statuses), raised.

``service_default`` is what a client that names no mode gets (the gateway's
``--default-mode``); beside it each mode as a client asks for it: ``service_dense``,
``bm25`` (sparse), ``hybrid_rrf`` and ``hybrid_weighted``, and with ``rerank`` CELI over
``service_dense`` and over ``hybrid_weighted``: the report's hybrid section pairs them
against ``service_dense`` on the dev queries.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

from gtr_client import Client, Consistency, Fusion, FusionMethod, Mode
from services.eval.config import DEPTH, EvalConfig
from services.eval.data import EvalData
from services.eval.inprocess import Run, Systems, dev_queries, held_out_queries

# name → (mode, fusion method); None: the gateway's default
MODES: dict[str, tuple[Mode | None, FusionMethod | None]] = {
    "service_dense": (Mode.DENSE, None),
    "bm25": (Mode.SPARSE, None),
    "hybrid_rrf": (Mode.HYBRID, FusionMethod.RRF),
    "hybrid_weighted": (Mode.HYBRID, FusionMethod.WEIGHTED),
}

# Opens a client of the gateway (closed by the evaluation when it is done).
Connect = Callable[[], Client]


def search_run(
    client: Client,
    data: EvalData,
    qids: list[str],
    cfg: EvalConfig,
    nprobe: int = 0,
    rerank: bool = False,
    desc: str = "search",
    mode: Mode | None = None,
    fusion: FusionMethod | None = None,
) -> Run:
    run: Run = {}
    k = min(DEPTH, len(data.beir.doc_ids))
    for q in tqdm(qids, desc=desc, disable=not cfg.progress):
        result = client.search(
            data.beir.queries[q],
            k=k,
            nprobe=nprobe,
            ids_only=True,
            consistency=Consistency.STRONG,
            require_complete=True,
            rerank=rerank,
            rerank_depth=cfg.rerank_depth if rerank else 0,
            mode=mode,
            fusion=Fusion(method=fusion) if fusion else None,
            timeout=cfg.timeout_s,
        )
        run[q] = result.ids
    return run


def evaluate_through_gateway(
    data: EvalData, cfg: EvalConfig, connect: Connect, ingest: Callable[[], int] | None
) -> Systems:
    out = Systems()
    if ingest is not None:
        start = time.perf_counter()
        out.index["ingested"] = ingest()
        out.seconds["ingest"] = time.perf_counter() - start
    with connect() as client:
        start = time.perf_counter()
        out.runs["service_default"] = search_run(client, data, data.qids, cfg)
        out.seconds["service_default"] = time.perf_counter() - start
        for name, (mode, fusion) in MODES.items():
            start = time.perf_counter()
            out.runs[name] = search_run(
                client, data, data.qids, cfg, desc=name, mode=mode, fusion=fusion
            )
            out.seconds[name] = time.perf_counter() - start
        out.dev = dev_queries(cfg, data.qids)
        for nprobe in sorted(set(cfg.nprobes)):
            out.runs[f"service_nprobe_{nprobe}"] = search_run(
                client, data, data.qids, cfg, nprobe, desc=f"search nprobe {nprobe}"
            )
        if cfg.rerank_checkpoint is not None:
            held = held_out_queries(Path(cfg.rerank_checkpoint), data.qids)
            start = time.perf_counter()
            out.runs["service_default+rerank"] = search_run(
                client, data, held, cfg, rerank=True, desc="search + rerank"
            )
            for name in ("service_dense", "hybrid_weighted"):
                mode, fusion = MODES[name]
                out.runs[f"{name}+rerank"] = search_run(
                    client,
                    data,
                    held,
                    cfg,
                    rerank=True,
                    desc=f"{name} + rerank",
                    mode=mode,
                    fusion=fusion,
                )
            out.seconds["rerank"] = time.perf_counter() - start
            out.rerank = {
                "checkpoint": str(cfg.rerank_checkpoint),
                "depth": cfg.rerank_depth,
                "queries": held,
                "note": "the gateway's reranker must serve this "
                "checkpoint (up --rerank-checkpoint)",
            }
    out.index["gateway"] = cfg.gateway
    return out
