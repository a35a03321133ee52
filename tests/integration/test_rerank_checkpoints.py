"""A rerank service serving several checkpoints by name (``--checkpoint-dir``, issue #35):
a real server (``start_rerank``, port 0) on a tiny default checkpoint, with two more tiny
checkpoints of other head seeds under its checkpoint directory, driven over gRPC and
through the gateway's own rerank client and its ``finish`` (the gateway's rerank step).

* a request naming a checkpoint is scored by it (its name in ``model``, its scores, not
  the default's), loaded on first use, at most ``max_loaded`` kept (least recently used
  dropped);
* an unknown name is NOT_FOUND and a name that would leave the directory
  INVALID_ARGUMENT, both naming it; the gateway skips a rerank whose generation names a
  checkpoint the service lacks and says why, and keeps the first-stage order;
* a weight below 1 mixes the reranker's and the first stage's scores (the order is the
  interpolation of what the named checkpoint scored).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest

from retrieval.v1 import rerank_pb2, rerank_pb2_grpc
from services.common.deadline import Deadline
from services.common.domain import Document, Hit
from services.common.errors import NotFound
from services.gateway.domain import SearchQuery
from services.gateway.rerank_client import RerankClient
from services.gateway.reranking import RerankPlan, finish, interpolate
from services.rerank.serve.server import Reranker
from tests.support.rerank import WORDS, rerank_in_background, tiny_checkpoint

TEXTS = ["read a csv file", "json bytes list", "thread pool hash", "row of csv", "file bytes"]
QUERY = "read csv rows"


@dataclass
class Served:
    reranker: Reranker
    stub: rerank_pb2_grpc.RerankServiceStub
    address: str


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    base = tmp_path_factory.mktemp("rerank-by-name")
    shelf = base / "shelf"
    tiny_checkpoint(shelf, WORDS, seed=1, name="alpha")
    tiny_checkpoint(shelf, WORDS, seed=2, name="beta")
    for backbone in shelf.glob("bert-*"):  # the backbones the checkpoints copied
        backbone.rename(base / backbone.name)
    # a checkpoint outside the shelf, and a link to it inside: not served by name
    (shelf / "link").symlink_to(tiny_checkpoint(base, WORDS, seed=3, name="outside"))
    with rerank_in_background(base, checkpoint_dir=str(shelf), max_loaded=1) as reranker:
        address = f"127.0.0.1:{reranker.port}"
        with grpc.insecure_channel(address) as channel:
            yield Served(reranker, rerank_pb2_grpc.RerankServiceStub(channel), address)


def _request(checkpoint: str = "") -> rerank_pb2.RerankRequest:
    return rerank_pb2.RerankRequest(
        query=QUERY,
        candidates=[rerank_pb2.RerankCandidate(id=f"d{i}", text=t) for i, t in enumerate(TEXTS)],
        checkpoint=checkpoint,
    )


def _scores(reply: rerank_pb2.RerankResponse) -> dict[str, float]:
    return {h.id: round(h.score, 5) for h in reply.hits}


def test_a_named_checkpoint_scores_the_request_and_is_loaded_on_first_use(served: Served) -> None:
    default = served.stub.Rerank(_request(), timeout=60)
    alpha = served.stub.Rerank(_request("alpha"), timeout=60)
    assert alpha.model.startswith("alpha:") and not default.model.startswith("alpha")
    assert _scores(alpha) != _scores(default)
    assert served.reranker.pool.loaded() == ["alpha"]
    beta = served.stub.Rerank(_request("beta"), timeout=60)
    assert beta.model.startswith("beta:") and _scores(beta) != _scores(alpha)
    # max_loaded=1: alpha was dropped for beta; asked again, it is loaded again, alike
    assert served.reranker.pool.loaded() == ["beta"]
    again = served.stub.Rerank(_request("alpha"), timeout=60)
    assert _scores(again) == _scores(alpha) and served.reranker.pool.loaded() == ["alpha"]


@pytest.mark.parametrize(
    ("name", "code", "says"),
    [
        ("gamma", grpc.StatusCode.NOT_FOUND, "no checkpoint gamma/"),
        ("link", grpc.StatusCode.NOT_FOUND, "no checkpoint link/"),  # leads out of it
        ("../shelf", grpc.StatusCode.INVALID_ARGUMENT, "'../shelf'"),
        (".hidden", grpc.StatusCode.INVALID_ARGUMENT, "'.hidden'"),
    ],
)
def test_an_unknown_or_escaping_name_is_refused_naming_it(
    served: Served, name: str, code: grpc.StatusCode, says: str
) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        served.stub.Rerank(_request(name), timeout=60)
    assert refused.value.code() is code
    assert says in (refused.value.details() or "")


def _hits() -> list[Hit]:
    # first-stage scores falling with the position: the first stage's order is d0..d4
    return [
        Hit(f"d{i}", 1.0 - i / 10, 0, 1.0 - i / 10, Document(f"d{i}", t))
        for i, t in enumerate(TEXTS)
    ]


def test_the_gateway_reranks_with_the_generations_checkpoint_and_weight(served: Served) -> None:
    async def run() -> None:
        client = RerankClient(served.address)
        try:
            q = SearchQuery(QUERY, 5, rerank=True)
            named = await client.rerank(QUERY, _hits(), timeout=60, checkpoint="beta")
            with pytest.raises(NotFound, match="gamma"):
                await client.rerank(QUERY, _hits(), timeout=60, checkpoint="gamma")

            plan = RerankPlan(5, "", "setting", "beta", 0.5)
            mixed = await finish(q, plan, _hits(), [], Deadline.after(60), client)
            assert mixed.reranked and not mixed.rerank_skipped
            assert [h.id for h in mixed.hits] == [h.id for h in interpolate(_hits(), named, 0.5)]

            alone = await finish(
                q, RerankPlan(5, "", "setting", "beta"), _hits(), [], Deadline.after(60), client
            )
            assert [h.id for h in alone.hits] == [h.id for h in named]

            missing = RerankPlan(5, "", "setting", "gamma", 0.5)
            skipped = await finish(q, missing, _hits(), [], Deadline.after(60), client)
            assert skipped.rerank_skipped and not skipped.reranked
            assert "checkpoint 'gamma' is not served" in skipped.rerank_skipped_reason
            assert [h.id for h in skipped.hits] == ["d0", "d1", "d2", "d3", "d4"]
        finally:
            await client.close()

    asyncio.run(run())
