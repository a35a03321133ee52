"""The evaluation through a running gateway: what a client of the service gets.

The corpus is upserted first (``ingest``; the same documents again are a no-op for the
index), then every query is one ``Search`` (k = 100, ``ids_only``, STRONG consistency so
the ingest is visible), at the server's default nprobe and at the nprobe values asked
for; with ``rerank`` the gateway also reranks (its CELI, ``rerank_depth``) the held-out
queries, as in the in-process path. Errors are the gateway's gRPC statuses, raised.

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

import grpc
from tqdm import tqdm

from retrieval.v1 import common_pb2, search_pb2, search_pb2_grpc
from services.eval.config import DEPTH, EvalConfig
from services.eval.data import EvalData
from services.eval.inprocess import Run, Systems, dev_queries, held_out_queries

DENSE = search_pb2.RETRIEVAL_MODE_DENSE
SPARSE = search_pb2.RETRIEVAL_MODE_SPARSE
HYBRID = search_pb2.RETRIEVAL_MODE_HYBRID
# name → (mode, fusion method); UNSPECIFIED: the gateway's default
MODES: dict[str, tuple[int, int]] = {
    "service_dense": (DENSE, 0),
    "bm25": (SPARSE, 0),
    "hybrid_rrf": (HYBRID, search_pb2.FUSION_METHOD_RRF),
    "hybrid_weighted": (HYBRID, search_pb2.FUSION_METHOD_WEIGHTED),
}

Channel = Callable[[], grpc.Channel]


def search_run(
    stub: search_pb2_grpc.SearchServiceStub,
    data: EvalData,
    qids: list[str],
    cfg: EvalConfig,
    nprobe: int = 0,
    rerank: bool = False,
    desc: str = "search",
    mode: int = 0,
    fusion: int = 0,
) -> Run:
    run: Run = {}
    k = min(DEPTH, len(data.beir.doc_ids))
    for q in tqdm(qids, desc=desc, disable=not cfg.progress):
        request = search_pb2.SearchRequest(
            query=data.beir.queries[q],
            k=k,
            nprobe=nprobe,
            ids_only=True,
            consistency=common_pb2.CONSISTENCY_STRONG,
            require_complete=True,
            rerank=search_pb2.RerankOptions(
                enabled=rerank, depth=cfg.rerank_depth if rerank else 0
            ),
            mode=mode,  # type: ignore[arg-type]
            fusion=search_pb2.Fusion(method=fusion) if fusion else None,  # type: ignore[arg-type]
        )
        response = stub.Search(request, timeout=cfg.timeout_s)
        run[q] = [hit.id for hit in response.hits]
    return run


def evaluate_through_gateway(
    data: EvalData, cfg: EvalConfig, channel: Channel, ingest: Callable[[], int] | None
) -> Systems:
    out = Systems()
    if ingest is not None:
        start = time.perf_counter()
        out.index["ingested"] = ingest()
        out.seconds["ingest"] = time.perf_counter() - start
    with channel() as ch:
        stub = search_pb2_grpc.SearchServiceStub(ch)
        start = time.perf_counter()
        out.runs["service_default"] = search_run(stub, data, data.qids, cfg)
        out.seconds["service_default"] = time.perf_counter() - start
        for name, (mode, fusion) in MODES.items():
            start = time.perf_counter()
            out.runs[name] = search_run(
                stub, data, data.qids, cfg, desc=name, mode=mode, fusion=fusion
            )
            out.seconds[name] = time.perf_counter() - start
        out.dev = dev_queries(cfg, data.qids)
        for nprobe in sorted(set(cfg.nprobes)):
            out.runs[f"service_nprobe_{nprobe}"] = search_run(
                stub, data, data.qids, cfg, nprobe, desc=f"search nprobe {nprobe}"
            )
        if cfg.rerank_checkpoint is not None:
            held = held_out_queries(Path(cfg.rerank_checkpoint), data.qids)
            start = time.perf_counter()
            out.runs["service_default+rerank"] = search_run(
                stub, data, held, cfg, rerank=True, desc="search + rerank"
            )
            for name in ("service_dense", "hybrid_weighted"):
                mode, fusion = MODES[name]
                out.runs[f"{name}+rerank"] = search_run(
                    stub,
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
