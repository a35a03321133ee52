"""A rollout carries its retrieval setting (issue #35, docs/generations.md "Retrieval
setting"), end to end on real parts: a real redis-server, generation g1's two shard
processes and a real gateway (in-process encoder, the alias re-read every 100 ms; the
stack of tests/support/background.py) reranking on a real rerank server whose
``--checkpoint-dir`` holds a tiny checkpoint "celi-a", 300 documents written by the real
writer; then the
real rollout builder (the documents re-embedded by all-MiniLM-L6-v2 in this process) runs
the plan ``index rollout --retrieval-setting FILE`` makes, and g2's shard processes start
on the index it trained.

* Before: a search that names no fusion is fused as the gateway's flags say (weighted).
* The rollout records the file's setting in g2's record; ``index generations`` shows it.
* After the switch, the same search is answered by g2 with g2's fusion (RRF, k = 20: the
  answer's ``fusion`` and its scores, each at most 2 / (20 + 1)); a search naming its own
  fusion still gets its own.
* A search on g2 asking for a rerank (no depth) is reranked by g2's checkpoint (the rerank
  server loaded "celi-a", which nothing else names) at g2's depth, its scores the
  interpolation (weight 0.5) of min-max normalised scores: in [0, 1], best first.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from retrieval.v1 import rerank_pb2_grpc, search_pb2, search_pb2_grpc
from services.common.domain import Document, Hit
from services.common.fusion import Fusion, Method
from services.common.retrieval_setting import RetrievalSetting
from services.encoder.base import Encoder
from services.encoder.runtime.inprocess import InProcessEncoder
from services.gateway.reranking import interpolate
from services.generations.builder import RolloutBuilder, RolloutOptions
from services.generations.operations import plan_of, status
from services.generations.registry import EncoderSpec, Generation, Registry
from services.index.client.writer import DocRecord
from services.index.keys import GenerationKeys, Layout
from services.process.redis_client import sync_client
from services.rerank.domain import RerankQuery
from services.rerank.serve import convert
from services.rerank.serve.server import Reranker
from tests.support.background import stack_in_background
from tests.support.hash_store import write_async
from tests.support.processes import run_redis, wait_until
from tests.support.rerank import WORDS as RERANK_WORDS
from tests.support.rerank import rerank_in_background, tiny_checkpoint
from tests.support.shards import ShardProcess, scifact_vectors, shared_test_index, start_shard

# re-embeds 300 documents and starts four shard processes and a gateway
pytestmark = pytest.mark.slow

DOCS = 300  # IVF-PQ training of the target needs >= 256 points
DIM = 384
G1 = GenerationKeys("g1", Layout(2, 2))
WORDS = ["protein", "cell", "gene", "tumour", "virus", "vaccine", "brain", "insulin"]
QUERY = "protein cell gene"
SETTING = RetrievalSetting(
    fusion=Fusion(Method.RRF, rrf_k=20),
    candidates=50,
    rerank_checkpoint="celi-a",
    rerank_weight=0.5,
    rerank_depth=10,
    note="a test's choice",
)


@dataclass
class World:
    url: str
    client: Any
    stub: search_pb2_grpc.SearchServiceStub
    g2: Generation
    work: Path
    reranker: Reranker


def _docs() -> list[DocRecord]:
    rng = np.random.default_rng(7)
    out = []
    for i in range(DOCS):
        vec = rng.standard_normal(DIM).astype(np.float32)  # g1's own: g2 re-embeds
        text = " ".join(rng.choice(WORDS, 10))
        out.append(DocRecord(f"d{i}", vec / np.linalg.norm(vec), title=f"t{i}", text=text))
    return out


class _Shared(Encoder):
    """The module's encoder, not closed by the builder."""

    def __init__(self, inner: Encoder) -> None:
        self.inner, self.model_name, self.dim = inner, inner.model_name, inner.dim
        self.max_batch = inner.max_batch

    async def encode(self, texts: Any, kind: Any, timeout: float | None = None) -> Any:
        return await self.inner.encode(texts, kind, timeout)

    async def close(self) -> None:
        return None


def _rollout(url: str, root: Path, setting_file: Path) -> Generation:
    encoder = InProcessEncoder.torch(threads=1)

    async def encoders(spec: EncoderSpec) -> Encoder:
        return _Shared(encoder)

    options = RolloutOptions(index_root=root, batch=64, sample=DOCS, wait_for_shards=False)
    client = sync_client(url)
    try:
        builder = RolloutBuilder(client, encoders, options)
        return asyncio.run(builder.rollout(plan_of(None, None, False, setting_file)))
    finally:
        asyncio.run(encoder.close())
        client.close()


def _search(stub: search_pb2_grpc.SearchServiceStub, **fields: Any) -> Any:
    # nprobe unset: each generation's own (g2's index, trained on 300 points, has few lists)
    request = search_pb2.SearchRequest(query=QUERY, k=10, **fields)
    return stub.Search(request, timeout=30)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, scifact_dir: Path) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("retrieval-setting")
    index_dir = shared_test_index(tmp_path_factory.getbasetemp(), scifact_vectors(scifact_dir))
    g2_shards: list[ShardProcess] = []
    shelf = tmp / "rerank-checkpoints"  # the checkpoint alone (its backbone source beside)
    shelf.mkdir()
    tiny_checkpoint(tmp, RERANK_WORDS, seed=3, name="celi-a").rename(shelf / "celi-a")
    with (
        rerank_in_background(tmp / "rerank", checkpoint_dir=str(shelf)) as reranker,
        run_redis(tmp / "redis") as store,
        stack_in_background(
            store.url,
            index_dir,
            tmp,
            gateway_settings={
                "alias_refresh_ms": 100,
                "rerank_url": f"127.0.0.1:{reranker.port}",
            },
        ) as bg,
    ):
        client = sync_client(store.url)
        try:
            asyncio.run(write_async(store.url, G1, _docs(), dim=DIM, batch=64))
            with grpc.insecure_channel(bg.address) as channel:
                stub = search_pb2_grpc.SearchServiceStub(channel)
                before = _search(stub)
                yield from _after_rollout(store.url, client, stub, tmp, before, g2_shards, reranker)
        finally:
            for proc in g2_shards:
                proc.stop()
            client.close()


def _after_rollout(
    url: str,
    client: Any,
    stub: search_pb2_grpc.SearchServiceStub,
    tmp: Path,
    before: Any,
    g2_shards: list[ShardProcess],
    reranker: Reranker,
) -> Iterator[World]:
    # the gateway's flags (weighted, 0.5) answer g1's searches
    assert before.generation == "g1"
    assert before.fusion.method == search_pb2.FUSION_METHOD_WEIGHTED
    setting_file = SETTING.write(tmp / "setting.json")
    serving = _rollout(url, tmp / "generations", setting_file)
    assert serving.name == "g2"
    for shard in range(2):
        g2_shards.append(
            start_shard(
                index_dir=Path(serving.index_dir),
                redis_url=url,
                shard=shard,
                shards=2,
                work_dir=tmp,
                replica=f"g2-{shard}",
                settings={"generation": "g2"},
            )
        )
    Registry(client).set_addresses("g2", ";".join(p.address for p in g2_shards))

    last: list[str] = []

    def g2_answers() -> bool:
        try:
            reply = _search(stub)
        except grpc.RpcError as exc:  # g2's parts not built yet: retried each refresh
            last[:] = [f"{exc.code()}: {exc.details()}"]
            return False
        last[:] = [f"{reply.generation} {len(reply.hits)} hits, partial {reply.partial}"]
        return reply.generation == "g2" and len(reply.hits) == 10 and not reply.partial

    try:
        wait_until(g2_answers, "the gateway answers with g2", 60, interval=0.2)
    except AssertionError as exc:
        raise AssertionError(f"{exc} (last: {last})") from None
    assert reranker.pool.loaded() == []  # nothing named celi-a yet
    yield World(url, client, stub, serving, tmp, reranker)


def test_the_rollout_records_the_files_setting_in_the_new_generations_record(
    world: World,
) -> None:
    assert world.g2.retrieval == SETTING
    assert Registry(world.client).get("g1").retrieval is None  # g1 keeps the flags
    rows = {
        r["name"]: r for r in json.loads(json.dumps(status(world.client).to_json()))["generations"]
    }
    assert rows["g2"]["retrieval"]["fusion"] == {"method": "rrf", "rrf_k": 20, "dense_weight": 0.5}
    assert "retrieval" not in rows["g1"]


def test_index_generations_shows_the_setting(
    world: World, capsys: pytest.CaptureFixture[str]
) -> None:
    from services.cli.main import main

    assert main(["index", "generations", "--redis-url", world.url]) == 0
    out = capsys.readouterr().out
    assert (
        "g2 retrieval setting: rrf k=20, 50 candidates; rerank celi-a depth 10 weight 0.5"
    ) in out
    assert "g1 retrieval setting" not in out


def test_a_search_naming_no_fusion_gets_the_serving_generations_fusion(world: World) -> None:
    reply = _search(world.stub)
    assert reply.generation == "g2"
    assert (reply.fusion.method, reply.fusion.rrf_k) == (search_pb2.FUSION_METHOD_RRF, 20)
    assert reply.fusion.candidates == 50  # the setting's, reported back
    # RRF scores: at most 1/(20 + 1) from each of the two lists
    assert reply.hits and all(0 < h.score <= 2 / 21 + 1e-6 for h in reply.hits)


def test_a_search_naming_its_fusion_still_gets_its_own(world: World) -> None:
    own = search_pb2.Fusion(method=search_pb2.FUSION_METHOD_WEIGHTED, dense_weight=0.8)
    reply = _search(world.stub, fusion=own)
    assert reply.generation == "g2"
    assert reply.fusion.method == search_pb2.FUSION_METHOD_WEIGHTED
    assert reply.fusion.dense_weight == pytest.approx(0.8)


def test_a_rerank_on_g2_uses_g2s_checkpoint_depth_and_weight(world: World) -> None:
    first = _search(world.stub)  # the same first stage, not reranked
    reply = _search(world.stub, rerank=search_pb2.RerankOptions(enabled=True))
    assert reply.generation == "g2"
    assert reply.reranked and not reply.rerank_skipped, reply.rerank_skipped_reason
    assert reply.rerank_depth == 10  # the setting's, not the depth table's
    assert world.reranker.pool.loaded() == ["celi-a"]  # the gateway named it

    # What celi-a scores those candidates, mixed half and half with the first stage
    candidates = [
        Hit(h.id, h.score, h.shard, h.score, Document(h.id, h.text, h.title)) for h in first.hits
    ]
    with grpc.insecure_channel(f"127.0.0.1:{world.reranker.port}") as channel:
        scored = rerank_pb2_grpc.RerankServiceStub(channel).Rerank(
            convert.query_to_pb(RerankQuery(QUERY, tuple(candidates), 0, "celi-a")), timeout=60
        )
    reranked = convert.result_from_pb(scored, candidates).hits
    want = interpolate(candidates, reranked, 0.5)
    assert [h.id for h in reply.hits] == [h.id for h in want]
    assert [h.score for h in reply.hits] == pytest.approx([h.score for h in want], abs=1e-5)
