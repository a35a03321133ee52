"""The public API end to end: real Redis, real Triton, real shard and gateway servers.

Upsert → Search → Delete → Search through the gateway over gRPC, and the gateway's
answers to malformed requests.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from loadtest import bottleneck, placement
from loadtest.target import Target
from retrieval.v1 import (
    common_pb2,
    documents_pb2,
    documents_pb2_grpc,
    search_pb2,
    search_pb2_grpc,
)
from services.encoder.build.export import export_onnx
from services.encoder.build.repository import generate_repository
from services.encoder.model import default_model_dir
from services.encoder.serve.triton_server import TritonHandle, TritonServerConfig, run_triton
from services.index.core.train import TrainOptions, train_index
from tests.support.processes import free_port
from tests.support.sample_docs import STDLIB_DOCS
from tests.support.stack import running_stack

DOCS = STDLIB_DOCS


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory: pytest.TempPathFactory, scifact_dir: Path) -> Path:
    """IVF-PQ trained on real all-MiniLM-L6-v2 embeddings (SciFact), as in production."""
    vectors = np.load(scifact_dir / "corpus.all-MiniLM-L6-v2.npy")[:3000]
    out = tmp_path_factory.mktemp("index")
    train_index(vectors, out, TrainOptions(model="all-MiniLM-L6-v2"))
    return out


@pytest.fixture(scope="module")
def triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonHandle]:
    root = tmp_path_factory.mktemp("triton")
    onnx = root / "export" / "model.onnx"
    export_onnx(default_model_dir(), onnx)
    generate_repository(onnx, root / "repo")
    cfg = TritonServerConfig(
        model_repository=root / "repo",
        grpc_port=free_port(),
        http_port=free_port(),
        metrics_port=free_port(),
        backend_dir=root / "backends",
    )
    with run_triton(cfg, root / "triton.log") as handle:
        yield handle


@pytest.fixture(scope="module")
def triton_url(triton: TritonHandle) -> str:
    return triton.grpc_url


def _docs() -> list[documents_pb2.Document]:
    return [
        documents_pb2.Document(id=i, title=t, text=x, metadata={"lang": "py"}) for i, t, x in DOCS
    ]


@pytest.mark.slow
def test_upsert_search_delete_search(
    any_redis_url: str, index_dir: Path, triton_url: str, tmp_path: Path
) -> None:
    """On one Redis and on a Redis Cluster (``any_redis_url``)."""

    async def scenario() -> None:
        async with running_stack(
            any_redis_url, index_dir, tmp_path, triton_url=triton_url
        ) as stack:
            async with grpc.aio.insecure_channel(stack.address) as channel:
                docs = documents_pb2_grpc.DocumentServiceStub(channel)
                search = search_pb2_grpc.SearchServiceStub(channel)

                up = await docs.Upsert(documents_pb2.UpsertRequest(documents=_docs()), timeout=30)
                assert up.upserted == len(DOCS)
                assert {p.shard for p in up.write_token.positions} <= {0, 1}

                request = search_pb2.SearchRequest(
                    query="how do I read a csv file",
                    k=3,
                    consistency=common_pb2.CONSISTENCY_SESSION,
                    write_token=up.write_token,
                )
                reply = await search.Search(request, timeout=30)
                assert reply.hits[0].id == "py-csv"
                assert reply.hits[0].title == "csv.reader"
                assert reply.hits[0].metadata["lang"] == "py"
                assert reply.model == "all-MiniLM-L6-v2"
                assert not reply.partial
                assert reply.timings.total_ms > 0

                got = await docs.Get(documents_pb2.GetRequest(id="py-json"), timeout=5)
                assert got.document.text == DOCS[1][2]

                gone = await docs.Delete(
                    documents_pb2.DeleteRequest(ids=["py-csv", "no-such-doc"]), timeout=5
                )
                assert gone.deleted == 1 and list(gone.not_found) == ["no-such-doc"]

                request.write_token.CopyFrom(gone.write_token)
                after = await search.Search(request, timeout=30)
                assert "py-csv" not in [h.id for h in after.hits]
                assert after.hits, "the other documents are still found"

                strong = await search.Search(
                    search_pb2.SearchRequest(
                        query="sha256 digest of bytes",
                        k=1,
                        consistency=common_pb2.CONSISTENCY_STRONG,
                    ),
                    timeout=30,
                )
                assert strong.hits[0].id == "py-hash"

                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await docs.Get(documents_pb2.GetRequest(id="py-csv"), timeout=5)
                assert err.value.code() == grpc.StatusCode.NOT_FOUND

    asyncio.run(scenario())


BAD_SEARCHES = [
    (search_pb2.SearchRequest(query="", k=5), "query: must not be empty"),
    (search_pb2.SearchRequest(query="x", k=0), "k: 0 is out of range 1..1000"),
    (search_pb2.SearchRequest(query="x", k=100000), "k: 100000 is out of range 1..1000"),
    (
        search_pb2.SearchRequest(query="x", k=5, consistency=common_pb2.CONSISTENCY_SESSION),
        "write_token: required",
    ),
    (search_pb2.SearchRequest(query="x", k=5, nprobe=100000), "nprobe"),
]


def test_malformed_requests_are_invalid_argument(
    redis_url: str, index_dir: Path, tmp_path: Path
) -> None:
    async def scenario() -> None:
        async with running_stack(redis_url, index_dir, tmp_path) as stack:
            async with grpc.aio.insecure_channel(stack.address) as channel:
                search = search_pb2_grpc.SearchServiceStub(channel)
                docs = documents_pb2_grpc.DocumentServiceStub(channel)
                for request, needle in BAD_SEARCHES:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await search.Search(request, timeout=10)
                    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, request
                    assert needle in err.value.details()

                batch = search_pb2.BatchSearchRequest(
                    requests=[search_pb2.SearchRequest(query="x", k=1)] * 65
                )
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await search.BatchSearch(batch, timeout=10)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "a batch takes 1..64" in err.value.details()

                # k sent as a string on the wire: a known field with the wrong type
                raw = channel.unary_unary("/retrieval.v1.SearchService/Search")
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await raw(bytes([0x0A, 1, ord("x"), 0x12, 2]) + b"10", timeout=10)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "field k" in err.value.details()

                bad_upsert = documents_pb2.UpsertRequest(
                    documents=[
                        documents_pb2.Document(id="a", text="fine"),
                        documents_pb2.Document(id="a", text="twice"),
                    ]
                )
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await docs.Upsert(bad_upsert, timeout=10)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "appears twice" in err.value.details()
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await docs.Get(documents_pb2.GetRequest(id="a"), timeout=10)
                assert err.value.code() == grpc.StatusCode.NOT_FOUND, "nothing was stored"

                ok = await search.BatchSearch(
                    search_pb2.BatchSearchRequest(
                        requests=[search_pb2.SearchRequest(query=q, k=2) for q in ("a", "b")]
                    ),
                    timeout=30,
                )
                assert len(ok.responses) == 2

    asyncio.run(scenario())


@pytest.mark.slow
def test_the_bottleneck_ratio_in_both_placements_puts_every_cpu_back(
    redis_url: str, index_dir: Path, triton: TritonHandle, tmp_path: Path
) -> None:
    """``loadtest.bottleneck`` against a real gateway and a real Triton: shared and split
    placements both measured, Triton's CPU (its Python-backend stub included) counted
    per call, and every thread's CPUs as they were afterwards."""
    usable = placement.usable_cpus()
    if len(usable) < 2:
        pytest.skip(f"the split placement needs two usable CPUs; this process has {usable}")
    family = placement.with_descendants(triton.process.pid)
    assert len(family) >= 2, "the stub of the Python backend runs below tritonserver"

    def affinities() -> dict[int, set[int]]:
        pids = [*family, os.getpid()]
        return {t: os.sched_getaffinity(t) for p in pids for t in placement.threads(p)}

    before = affinities()
    stack = {"children": [{"name": "triton", "pid": triton.process.pid, "state": "running"}]}
    args = bottleneck.build_parser().parse_args(
        ["--seconds", "0.5", "--rounds", "1", "--concurrency", "4"]
    )

    async def scenario() -> dict[str, Any]:
        async with running_stack(redis_url, index_dir, tmp_path, triton_url=triton.grpc_url) as s:
            async with grpc.aio.insecure_channel(s.address) as channel:
                docs = documents_pb2_grpc.DocumentServiceStub(channel)
                await docs.Upsert(documents_pb2.UpsertRequest(documents=_docs()), timeout=30)
            queries = ["read a csv file", "parse json", "hash some bytes"]
            return await asyncio.to_thread(
                bottleneck.measure_placements,
                Target(s.address),
                triton.grpc_url,
                queries,
                args,
                stack,
            )

    out = asyncio.run(scenario())
    assert out["placement"] == "split" and out["ratio"] == out["split"]["ratio"]
    split = placement.split_cpus(usable)
    for name in ("shared", "split"):
        result = out[name]
        assert result["gateway_errors"] == 0 and result["ratio"] > 0
        assert result["cpu_ms_per_encode"]["triton"] > 0
        assert result["cpu_ms_per_search"]["triton"] > 0
        assert result["cpu_ms_per_search"]["generator"] > 0  # the gateway runs in here
    assert out["split"]["encoder_cpus"] == sorted(split.encoder)
    assert out["split"]["stack_cpus"] == sorted(split.stack)
    after = affinities()
    common = before.keys() & after.keys()
    assert any(t in common for t in placement.threads(triton.process.pid))
    assert {t: after[t] for t in common} == {t: before[t] for t in common}
