"""Retrieval modes through the real gateway (gRPC, the real MiniLM encoder, two real shard
servers with their text indexes, real Redis, a real rerank server): a client that names
no mode gets the default (hybrid, weighted fusion); dense, sparse and hybrid answer with
their mode and each hit's ranks; CELI reranks the fused candidates; a deleted document
never comes back in sparse or hybrid results; bad modes and fusions, and fusion parameters
sent with a dense or sparse search (also one that gets a dense default mode), are
INVALID_ARGUMENT.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from retrieval.v1 import (
    common_pb2,
    documents_pb2,
    documents_pb2_grpc,
    search_pb2,
    search_pb2_grpc,
)
from services.gateway.server import start_gateway
from services.gateway.settings import GatewaySettings
from tests.support.background import BackgroundStack, scifact_stack_with_rerank

DOCS = [
    ("csv-py", "csv.reader", "Read rows of a csv file one list at a time."),
    ("json-py", "json.loads", "Parse a json document into Python objects."),
    ("hash-py", "hashlib", "Compute a sha256 digest of bytes."),
    ("pool-py", "ThreadPoolExecutor", "Run callables in a pool of threads."),
    ("zlib-py", "zlib", "Compress and decompress data with the deflate algorithm."),
    ("sock-py", "socket", "Open a TCP connection to a server and send bytes."),
]
HYBRID = search_pb2.RETRIEVAL_MODE_HYBRID
DENSE = search_pb2.RETRIEVAL_MODE_DENSE
SPARSE = search_pb2.RETRIEVAL_MODE_SPARSE


class Front:
    def __init__(self, bg: BackgroundStack, redis_url: str, nlist: int) -> None:
        self.bg, self.redis_url = bg, redis_url
        address = bg.address
        self.channel = grpc.insecure_channel(address)
        self.search = search_pb2_grpc.SearchServiceStub(self.channel)
        self.docs = documents_pb2_grpc.DocumentServiceStub(self.channel)
        self.nlist = nlist
        self.token = common_pb2.WriteToken()

    def upsert(self, docs: list[tuple[str, str, str]]) -> None:
        pb = [documents_pb2.Document(id=i, title=t, text=x) for i, t, x in docs]
        self.token = self.docs.Upsert(
            documents_pb2.UpsertRequest(documents=pb), timeout=60
        ).write_token

    def ask(self, query: str, k: int = 6, **fields: object) -> search_pb2.SearchResponse:
        request = search_pb2.SearchRequest(
            query=query,
            k=k,
            nprobe=self.nlist,
            consistency=common_pb2.CONSISTENCY_SESSION,
            write_token=self.token,
            **fields,  # type: ignore[arg-type]
        )
        return self.search.Search(request, timeout=60)


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory, scifact_dir: Path) -> Iterator[Front]:
    with scifact_stack_with_rerank(tmp_path_factory, scifact_dir, "hybrid") as (bg, store, nlist):
        f = Front(bg, store.url, nlist)
        f.upsert(DOCS)
        yield f
        f.channel.close()


def test_a_client_that_names_no_mode_gets_hybrid_with_both_ranks(front: Front) -> None:
    reply = front.ask("sha256 digest")
    assert reply.mode == HYBRID and not reply.partial
    assert reply.fusion.method == search_pb2.FUSION_METHOD_WEIGHTED
    assert reply.fusion.dense_weight == pytest.approx(0.5)
    top = reply.hits[0]
    assert top.id == "hash-py" and top.sparse_rank == 1 and top.dense_rank >= 1
    assert top.score == top.first_stage_score <= 1.0  # the fused score, normalised
    assert all(h.dense_rank or h.sparse_rank for h in reply.hits)
    assert top.title == "hashlib"  # documents are fetched as for any search


def test_each_mode_answers_as_itself(front: Front) -> None:
    dense = front.ask("compress data", mode=DENSE)
    assert dense.mode == DENSE and not dense.HasField("fusion")
    assert all(h.dense_rank == 0 and h.sparse_rank == 0 for h in dense.hits)
    assert [h.first_stage_score for h in dense.hits] == sorted(
        (h.first_stage_score for h in dense.hits), reverse=True
    )
    sparse = front.ask("deflate", mode=SPARSE)
    assert sparse.mode == SPARSE and sparse.timings.encode_ms == 0  # not encoded
    assert [(h.id, h.sparse_rank) for h in sparse.hits] == [("zlib-py", 1)]
    rrf = front.ask(
        "deflate compress",
        mode=HYBRID,
        fusion=search_pb2.Fusion(method=search_pb2.FUSION_METHOD_RRF, rrf_k=10),
    )
    assert rrf.mode == HYBRID and rrf.fusion.rrf_k == 10
    top = rrf.hits[0]
    assert top.id == "zlib-py"
    expected = sum(1 / (10 + r) for r in (top.dense_rank, top.sparse_rank) if r)
    assert top.first_stage_score == pytest.approx(expected, rel=1e-5)
    # a query of no indexable term: an empty sparse answer, not an error
    nothing = front.ask("?! ...", mode=SPARSE)
    assert list(nothing.hits) == [] and not nothing.partial


def test_celi_reranks_the_fused_candidates(front: Front) -> None:
    fused = front.ask("read a csv file", k=4)
    reranked = front.ask(
        "read a csv file", k=4, rerank=search_pb2.RerankOptions(enabled=True, depth=6)
    )
    assert reranked.reranked and reranked.rerank_depth == 6 and reranked.mode == HYBRID
    # the reranker's order of the fused top 6: each hit keeps its ranks in both lists
    assert {h.id for h in reranked.hits} <= {h.id for h in front.ask("read a csv file").hits}
    assert all(h.dense_rank or h.sparse_rank for h in reranked.hits)
    assert {h.id for h in fused.hits} <= {d for d, _, _ in DOCS}


def test_a_batch_mixes_modes(front: Front) -> None:
    requests = [
        search_pb2.SearchRequest(query="deflate", k=2, mode=m, nprobe=front.nlist)
        for m in (DENSE, SPARSE, HYBRID, search_pb2.RETRIEVAL_MODE_UNSPECIFIED)
    ]
    replies = front.search.BatchSearch(
        search_pb2.BatchSearchRequest(requests=requests), timeout=60
    ).responses
    assert [r.mode for r in replies] == [DENSE, SPARSE, HYBRID, HYBRID]
    assert all(r.hits[0].id == "zlib-py" for r in replies)


def test_only_an_encoded_query_names_the_model_and_its_encode_time(front: Front) -> None:
    """A sparse query is not embedded: its answer names no model and no encode time, also
    in a batch whose dense query was encoded (the batch's encode time used to be given to
    every query, and the encoder's name to a sparse one)."""
    single = front.ask("deflate", mode=SPARSE)
    assert single.model == "" and single.timings.encode_ms == 0
    requests = [
        search_pb2.SearchRequest(query=q, k=2, mode=m, nprobe=front.nlist)
        for q, m in (("deflate", SPARSE), ("compress data", DENSE), ("csv rows", HYBRID))
    ]
    sparse, dense, hybrid = front.search.BatchSearch(
        search_pb2.BatchSearchRequest(requests=requests), timeout=60
    ).responses
    assert dense.model and dense.model == hybrid.model
    assert dense.timings.encode_ms > 0 and hybrid.timings.encode_ms == dense.timings.encode_ms
    assert sparse.model == "" and sparse.timings.encode_ms == 0
    assert sparse.timings.search_ms == dense.timings.search_ms  # one fan-out for the batch


def test_a_deleted_document_never_returns_in_sparse_or_hybrid(front: Front) -> None:
    front.upsert([("gone-py", "shelve", "A persistent quokka dictionary.")])
    assert front.ask("quokka", mode=SPARSE).hits[0].id == "gone-py"
    reply = front.docs.Delete(documents_pb2.DeleteRequest(ids=["gone-py"]), timeout=30)
    front.token = reply.write_token
    for mode in (SPARSE, HYBRID):
        assert "gone-py" not in {h.id for h in front.ask("quokka dictionary", mode=mode).hits}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"mode": 9}, "mode"),
        ({"fusion": search_pb2.Fusion(dense_weight=2.0)}, "dense_weight"),
        ({"fusion": search_pb2.Fusion(rrf_k=100_000)}, "rrf_k"),
        ({"fusion": search_pb2.Fusion(candidates=2)}, "candidates"),
    ],
)
def test_bad_modes_and_fusions_are_invalid_arguments(
    front: Front, fields: dict[str, object], message: str
) -> None:
    with pytest.raises(grpc.RpcError) as err:
        front.ask("csv", 6, **fields)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in (err.value.details() or "")


FUSION_FIELDS = [
    ({"fusion": search_pb2.Fusion(method=search_pb2.FUSION_METHOD_RRF)}, "fusion:"),
    ({"fusion": search_pb2.Fusion(rrf_k=10)}, "fusion:"),
    ({"fusion": search_pb2.Fusion(dense_weight=0.9)}, "fusion:"),
    ({"fusion": search_pb2.Fusion(candidates=20)}, "fusion.candidates:"),
]


@pytest.mark.parametrize("mode", [DENSE, SPARSE])
@pytest.mark.parametrize(("fields", "field"), FUSION_FIELDS)
def test_fusion_parameters_with_a_dense_or_sparse_mode_are_refused(
    front: Front, mode: int, fields: dict[str, object], field: str
) -> None:
    """They used to be dropped without a word: the answer looked like the fusion had run."""
    with pytest.raises(grpc.RpcError) as err:
        front.ask("deflate", 6, mode=mode, **fields)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = err.value.details() or ""
    assert details.startswith(field) and "only a hybrid search fuses" in details
    # the same in a batch names the request; an empty fusion message is no parameter
    requests = [
        search_pb2.SearchRequest(query="deflate", k=2, mode=HYBRID, **fields),  # type: ignore[arg-type]
        search_pb2.SearchRequest(query="deflate", k=2, mode=mode, fusion=search_pb2.Fusion()),  # type: ignore[arg-type]
        search_pb2.SearchRequest(query="deflate", k=2, mode=mode, **fields),  # type: ignore[arg-type]
    ]
    with pytest.raises(grpc.RpcError) as err:
        front.search.BatchSearch(search_pb2.BatchSearchRequest(requests=requests), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith(f"requests[2].{field}")


def test_fusion_parameters_meet_the_gateways_default_mode(front: Front) -> None:
    """A request that names no mode gets --default-mode: the check sees that mode, so a
    gateway that defaults to dense refuses a fusion, and the hybrid one takes it."""
    spec = ";".join(",".join(f"127.0.0.1:{x.port}" for x in reps) for reps in front.bg.stack.shards)
    dense_gateway = front.bg.run(
        start_gateway(
            GatewaySettings(
                port=0,
                redis_url=front.redis_url,
                shards=spec,
                encoder="inprocess",
                triton_url="127.0.0.1:1",
                auth=False,
                default_mode="dense",
            )
        )
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{dense_gateway.port}") as channel:
            stub = search_pb2_grpc.SearchServiceStub(channel)
            rrf = search_pb2.Fusion(method=search_pb2.FUSION_METHOD_RRF)
            with pytest.raises(grpc.RpcError) as err:
                stub.Search(search_pb2.SearchRequest(query="deflate", k=2, fusion=rrf), timeout=60)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "mode is dense (the gateway's default, --default-mode)" in (
                err.value.details() or ""
            )
            asked = search_pb2.SearchRequest(query="deflate", k=2, mode=HYBRID, fusion=rrf)
            assert stub.Search(asked, timeout=60).mode == HYBRID
    finally:
        front.bg.run(dense_gateway.close(0))
    assert front.ask("deflate", k=2, fusion=search_pb2.Fusion(rrf_k=10)).fusion.rrf_k == 10


def test_the_gateway_reports_its_searches_latency_for_a_rollouts_pacing(front: Front) -> None:
    """Every second the gateway writes the p50/p99 of the searches it answered in the
    last 5 s under a field of its own in {gtr}:search-latency; a rollout's builder reads
    the slowest of them (services/generations/pacing.py) and sees these searches."""
    import time

    import redis

    from services.generations import pacing, serving_latency
    from tests.support.processes import wait_until

    slowest = 0.0
    started: list[float] = []
    for n in range(pacing.MIN_SEARCHES + 5):
        started.append(time.time())
        start = time.perf_counter()
        front.search.Search(search_pb2.SearchRequest(query=f"csv rows {n}", k=3), timeout=60)
        slowest = max(slowest, (time.perf_counter() - start) * 1e3)
    ended = time.time()
    client = redis.Redis.from_url(front.redis_url)
    try:
        # a report written after the last search ended (one written mid-loop counts fewer)
        wait_until(
            lambda: any(r.at >= ended for r in serving_latency.read(client).values()),
            "a report written after those searches",
            timeout=10,
        )
        reports = serving_latency.read(client)
        p99 = pacing.slowest_p99(client)
    finally:
        client.close()
    assert len(reports) == 1, reports  # this one gateway
    (report,) = reports.values()
    # every search that started inside the report's window was recorded in it
    in_window = sum(1 for at in started if at >= report.at - serving_latency.WINDOW_S)
    assert in_window >= pacing.MIN_SEARCHES, "the searches above took longer than the window"
    assert report.searches >= in_window
    assert p99 == report.p99_ms and 0 < report.p50_ms <= report.p99_ms
    # the gateway's own time is inside what the client waited: half of these searches
    # (the window's median) took no longer than the slowest of them here
    assert report.p50_ms <= slowest
