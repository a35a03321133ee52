"""The gateway's rerank depth, end to end: real Redis, shards, rerank and gateway servers.

The depth comes from services/rerank/depths.py's rule applied to the table the gateway
is configured with (here a file written by the test, so that the table, not a default,
decides): the largest measured depth that fits 60 % of the time left, and no rerank at
all, said in the response, when even the smallest does not fit. A configured table that
cannot be read stops the gateway at start.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import numpy as np
import pytest

from retrieval.v1 import common_pb2, documents_pb2, documents_pb2_grpc, search_pb2, search_pb2_grpc
from services.gateway.server import start_gateway
from services.gateway.settings import GatewaySettings
from services.index.core.train import TrainOptions, train_index
from services.index.server.process import start_shard
from services.rerank.serve.server import start_rerank
from services.rerank.serve.settings import RerankSettings
from tests.support.processes import stop_process, wait_for_port, wait_until
from tests.support.rerank import WORDS, tiny_checkpoint
from tests.support.stack import shard_settings

DOCS = [
    documents_pb2.Document(id=f"d{i:02d}", title=f"topic {i}", text=f"{WORDS[i % 10]} doc {i}")
    for i in range(20)
]
# ms per query at each depth: depth 4 needs a 40 s deadline (60 % of it: 24 s), depth 12
# an 80 s one; below 40 s nothing fits. Deadlines that long cost nothing (the calls take
# well under a second) and leave the choice immune to a slow machine.
TABLE = {"ms_per_query_at_depth": {"4": 20_000.0, "12": 40_000.0}}


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory: pytest.TempPathFactory, scifact_dir: Path) -> Path:
    """8 lists, all probed: every stored document is a first-stage candidate."""
    vectors = np.load(scifact_dir / "corpus.all-MiniLM-L6-v2.npy")[:3000]
    out = tmp_path_factory.mktemp("index")
    train_index(vectors, out, TrainOptions(nlist=8, nprobe=8, model="all-MiniLM-L6-v2"))
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("rerank"), WORDS)


@asynccontextmanager
async def rerank_stack(
    redis_url: str,
    index_dir: Path,
    checkpoint: Path,
    tmp: Path,
    table: Path,
    rerank_url: str | None = None,
) -> AsyncIterator[search_pb2_grpc.SearchServiceStub]:
    """``rerank_url``: a reranker already running (else one is started here)."""
    shards = [
        await start_shard(shard_settings(s, 2, 0, redis_url, index_dir, tmp)) for s in range(2)
    ]
    reranker = None
    if rerank_url is None:
        reranker = await start_rerank(RerankSettings(port=0, checkpoint=str(checkpoint), threads=1))
        rerank_url = f"127.0.0.1:{reranker.port}"
    gateway = None
    try:
        gateway = await start_gateway(
            GatewaySettings(
                port=0,
                redis_url=redis_url,
                shards=";".join(f"127.0.0.1:{s.port}" for s in shards),
                encoder="inprocess",
                rerank_url=rerank_url,
                rerank_depth_table=str(table),
                auth=False,
            )
        )
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
            up = await documents_pb2_grpc.DocumentServiceStub(channel).Upsert(
                documents_pb2.UpsertRequest(documents=DOCS), timeout=60
            )
            assert up.upserted == len(DOCS)
            yield search_pb2_grpc.SearchServiceStub(channel)
    finally:
        if gateway is not None:
            await gateway.close(0)
        if reranker is not None:
            await reranker.close(0)
        for shard in shards:
            await shard.close(0, snapshot=False)


def _search() -> search_pb2.SearchRequest:
    return search_pb2.SearchRequest(
        query="read a csv file row by row",
        k=3,
        consistency=common_pb2.CONSISTENCY_STRONG,  # every upserted document is searchable
        rerank=search_pb2.RerankOptions(enabled=True),  # depth 0: chosen by the deadline
    )


@pytest.mark.slow
def test_the_configured_table_decides_the_depth_and_a_budget_too_small_skips_the_rerank(
    redis_url: str, index_dir: Path, checkpoint: Path, tmp_path: Path
) -> None:
    table = tmp_path / "depths.json"
    table.write_text(json.dumps(TABLE))

    async def scenario() -> None:
        async with rerank_stack(redis_url, index_dir, checkpoint, tmp_path, table) as search:
            deep = await search.Search(_search(), timeout=80)
            assert deep.reranked and deep.rerank_depth == 12, deep
            assert not deep.rerank_skipped and deep.rerank_skipped_reason == ""

            shallow = await search.Search(_search(), timeout=40)
            assert shallow.reranked and shallow.rerank_depth == 4, shallow

            # 60 % of 30 s is 18 s, below the 20 s of depth 4: the old gateway reranked
            # at the smallest depth anyway; now it answers in first-stage order and says so.
            skipped = await search.Search(_search(), timeout=30)
            assert not skipped.reranked and skipped.rerank_depth == 0
            assert skipped.rerank_skipped
            assert "no measured rerank depth fits" in skipped.rerank_skipped_reason
            assert len(skipped.hits) == 3
            assert [h.score for h in skipped.hits] == [h.first_stage_score for h in skipped.hits]
            scores = [h.first_stage_score for h in skipped.hits]
            assert scores == sorted(scores, reverse=True)

            # A request that names its depth is never skipped, whatever the deadline.
            named = _search()
            named.rerank.depth = 5
            explicit = await search.Search(named, timeout=30)
            assert explicit.reranked and explicit.rerank_depth == 5
            assert not explicit.rerank_skipped

    asyncio.run(scenario())


@pytest.mark.slow
def test_a_chosen_depth_the_reranker_overruns_answers_in_first_stage_order(
    redis_url: str, index_dir: Path, checkpoint: Path, tmp_path: Path
) -> None:
    """The table says depth 12 takes 1 ms; the reranker (a real ``rerank serve`` process)
    is SIGSTOPped, as on a machine far busier than the table's: a search whose depth the
    gateway chose answers OK before its deadline, in first-stage order, and says why it
    was not reranked (before: DEADLINE_EXCEEDED, the README's `search ... --rerank` on a
    busy machine). A search that names its depth still fails with its deadline."""
    table = tmp_path / "depths.json"
    table.write_text(json.dumps({"ms_per_query_at_depth": {"12": 1.0}}))
    port_file = tmp_path / "rerank.port"
    argv = [
        sys.executable,
        "-m",
        "services.cli.main",
        "rerank",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--port-file",
        str(port_file),
        "--checkpoint",
        str(checkpoint),
        "--threads",
        "1",
    ]
    with (tmp_path / "rerank.log").open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(
            lambda: port_file.exists() and port_file.read_text().strip() != "",
            "rerank serve wrote its port",
            120,
        )
        port = int(port_file.read_text())
        wait_for_port(port, 120)
        proc.send_signal(signal.SIGSTOP)

        async def scenario() -> None:
            url = f"127.0.0.1:{port}"
            async with rerank_stack(
                redis_url, index_dir, checkpoint, tmp_path, table, url
            ) as search:
                answer = await search.Search(_search(), timeout=3)  # else DEADLINE_EXCEEDED
                assert not answer.reranked and answer.rerank_depth == 0
                assert answer.rerank_skipped
                assert "did not finish" in answer.rerank_skipped_reason, answer
                assert len(answer.hits) == 3
                assert [h.score for h in answer.hits] == [h.first_stage_score for h in answer.hits]

                named = _search()
                named.rerank.depth = 5
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await search.Search(named, timeout=3)
                assert refused.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

        asyncio.run(scenario())
    finally:
        proc.send_signal(signal.SIGCONT)
        stop_process(proc)


@pytest.mark.parametrize("content", [None, "{not json", json.dumps({"ms_per_query_at_depth": {}})])
def test_a_configured_depth_table_that_cannot_be_read_stops_the_gateway_at_start(
    tmp_path: Path, content: str | None
) -> None:
    """The real command, as an operator starts it: it must exit with a message naming the
    file instead of serving with built-in defaults (the old gateway served forever)."""
    table = tmp_path / "depths.json"
    if content is not None:
        table.write_text(content)
    argv = [
        sys.executable,
        "-m",
        "services.cli.main",
        "gateway",
        "serve",
        "--port",
        "0",
        "--shards",
        "127.0.0.1:1",
        "--encoder",
        "inprocess",
        "--rerank-url",
        "127.0.0.1:2",
        "--no-auth",
        "--rerank-depth-table",
        str(table),
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "rerank_depth_table" in done.stderr and str(table) in done.stderr, done.stderr
