"""The gateway's client of the internal RerankService (implements ports.Reranker).

The depth table and its rule are :mod:`services.rerank.depths`' (no depth fits the
budget → 0, the rerank is skipped); the messages are built by
:mod:`services.rerank.serve.convert`, the conversions the rerank servicer uses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import grpc

from retrieval.v1 import rerank_pb2_grpc
from services.common.domain import Hit
from services.rerank import depths
from services.rerank.domain import RerankQuery
from services.rerank.serve import convert
from services.rpc.status import error_from_rpc
from services.rpc.tls import ClientTLS, Rotating, aio_channel
from services.telemetry import tracing


class RerankClient:
    def __init__(
        self,
        address: str,
        depth_table: Mapping[int, float] = depths.DEFAULT_DEPTH_TABLE,
        tls: ClientTLS | None = None,
    ) -> None:
        # rebuilt when the TLS files change on disk; the old channel closes once idle
        self._channels: Rotating[grpc.aio.Channel] = Rotating(
            lambda: aio_channel(address, tls), _close, tls, f"rerank {address}"
        )
        self._table = dict(depth_table)
        self.address = address

    def depth_for_budget(self, budget_ms: float) -> int:
        """The largest measured depth that fits ``budget_ms``; 0: none does, skip the rerank."""
        return depths.depth_for_budget(budget_ms, self._table)

    async def rerank(
        self,
        query: str,
        candidates: Sequence[Hit],
        timeout: float | None,
        checkpoint: str = "",
    ) -> list[Hit]:
        request = convert.query_to_pb(
            RerankQuery(query, tuple(candidates), len(candidates), checkpoint)
        )
        with tracing.span("rerank", tracing.CLIENT) as span:
            if span:
                span.set_attribute("gtr.candidates", len(candidates))
            try:
                with self._channels.use() as channel:
                    stub = rerank_pb2_grpc.RerankServiceStub(channel)
                    response = await stub.Rerank(
                        request, timeout=timeout, metadata=tracing.outgoing()
                    )
            except grpc.aio.AioRpcError as exc:
                raise error_from_rpc(exc, f"rerank at {self.address}") from None
        return list(convert.result_from_pb(response, candidates).hits)

    async def close(self) -> None:
        await self._channels.close()


async def _close(channel: grpc.aio.Channel) -> None:
    await channel.close()
