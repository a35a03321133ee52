"""The gateway's client of the internal RerankService (implements ports.Reranker)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import grpc

from retrieval.v1 import rerank_pb2, rerank_pb2_grpc
from services.common.status import error_from_rpc

# Conservative default cost table (ms per query at depth) used until a benchmark table
# (bench/rerank.py writes one) is configured: CPU, MiniLM-sized backbone, 2 threads.
DEFAULT_DEPTH_TABLE: dict[int, float] = {10: 510.0, 20: 1026.0, 50: 2854.0, 100: 5349.0}


def load_depth_table(path: str | None) -> dict[int, float]:
    if not path or not Path(path).exists():
        return dict(DEFAULT_DEPTH_TABLE)
    raw = json.loads(Path(path).read_text(encoding="utf-8"))
    table = raw.get("ms_per_query_at_depth", raw)
    return {int(k): float(v) for k, v in table.items()}


def depth_for_budget(budget_ms: float, table: dict[int, float]) -> int:
    """The largest measured depth whose cost fits ``budget_ms``; the smallest if none does."""
    fitting = [depth for depth, ms in table.items() if ms <= budget_ms]
    return max(fitting) if fitting else min(table)


class RerankClient:
    def __init__(self, address: str, depth_table: dict[int, float] | None = None) -> None:
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = rerank_pb2_grpc.RerankServiceStub(self._channel)
        self._table = depth_table or dict(DEFAULT_DEPTH_TABLE)
        self.address = address

    def depth_for_budget(self, budget_ms: float) -> int:
        return depth_for_budget(budget_ms, self._table)

    async def rerank(
        self, query: str, candidates: Sequence[tuple[str, str]], timeout: float | None
    ) -> list[tuple[int, float]]:
        request = rerank_pb2.RerankRequest(
            query=query,
            candidates=[rerank_pb2.RerankCandidate(id=i, text=t) for i, t in candidates],
            top_n=len(candidates),
        )
        try:
            response = await self._stub.Rerank(request, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc, f"rerank at {self.address}") from None
        return [(h.index, h.score) for h in response.hits]

    async def close(self) -> None:
        await self._channel.close()
