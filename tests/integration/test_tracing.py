"""Distributed tracing across real processes (issue #36 item 3), to a real OTLP receiver.

The test starts an OTLP receiver (OpenTelemetry's own ``TraceService/Export`` over gRPC,
and ``POST /v1/traces`` over HTTP for Triton, tests/support/otlp.py), then a real Triton
(the wheel's tritonserver, OpenTelemetry mode, OTLP/HTTP), two index shard processes, a
reranker process and a gateway process with ``--otlp-endpoint`` at ratio 1, all on free
ports, and drives the gateway as a client would, sending its own ``traceparent``:

- one search is one trace, the client's: the gateway's SERVER span is the child of the
  client's span; Triton's, both shards' and the reranker's spans are children of the
  gateway's client spans of those calls; the Redis document fetch and the fusion have
  spans; the gateway's latency histogram keeps the trace id as an exemplar;
- a search on the gateway's HTTP/JSON port (``--http-port``) with a ``traceparent``
  header is one trace the same way: its SERVER span is the child of the header's span,
  and the shards' spans hang under it;
- an upsert is one trace with the Redis script's span, which names the log entries it
  added; the shards' ``log apply`` spans name the same entries;
- a gateway started without tracing exports nothing and passes no context on.

Each fails on the code before tracing (no span is exported at all).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from retrieval.v1 import documents_pb2, documents_pb2_grpc, search_pb2, search_pb2_grpc
from services.encoder.build.repository import RepositoryConfig, generate_repository
from services.encoder.model import default_model_dir
from services.encoder.serve.triton_server import (
    TritonHandle,
    TritonServerConfig,
    run_triton,
    trace_args,
)
from tests.encoder_fixtures import encoder_base, ensure_onnx
from tests.support.otlp import Received, Receiver, otlp_receiver
from tests.support.processes import free_port, wait_until
from tests.support.rerank import WORDS, tiny_checkpoint
from tests.support.shards import ShardCluster, run_shards, scifact_vectors, train_test_index

pytestmark = pytest.mark.slow
REDIS_DB = 14  # module_redis: the processes outlive the per-test flush of db 0
ROOT = Path(__file__).resolve().parents[2]
DOCS = [
    documents_pb2.Document(id=f"d{i:02d}", title=f"topic {i}", text=f"{WORDS[i % 10]} doc {i}")
    for i in range(20)
]
# what the processes' span exporters wait between two exports (the SDK's default: 5 s)
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "100"}


@dataclass
class Process:
    name: str
    port: int
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(FAST_EXPORT)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = str(ROOT)
    return env


def _start(name: str, module: str, args: list[str], work: Path) -> Process:
    """``python -m module --port P args`` until its gRPC health says SERVING."""
    port = free_port()
    log = work / f"{name}.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, "--port", str(port), *args],
            cwd=ROOT,
            env=_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    started = Process(name, port, proc, log)

    def serving() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"{name} exited:\n{log.read_text(errors='replace')[-3000:]}")
        try:
            with grpc.insecure_channel(started.address) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=1.0
                )
            return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
        except grpc.RpcError:
            return False

    try:
        wait_until(serving, f"{name} serving", timeout=120, interval=0.1)
    except BaseException:
        started.stop()
        raise
    return started


@dataclass
class Stack:
    receiver: Receiver
    gateway: Process
    http_port: int  # the gateway's HTTP/JSON port (--http-port)
    metrics_port: int
    shards: ShardCluster
    triton: TritonHandle
    rerank: Process
    redis_url: str
    work: Path


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    with otlp_receiver() as r:
        yield r


@pytest.fixture(scope="module")
def stack(
    receiver: Receiver,
    module_redis: str,
    scifact_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("tracing")
    base = encoder_base(tmp_path_factory)
    vectors = scifact_vectors(scifact_dir)[:2000].astype(np.float32)
    index_dir = train_test_index(vectors, work / "index", nlist=8, nprobe=8)
    repo = work / "repo"
    generate_repository(ensure_onnx(default_model_dir(), base), repo, RepositoryConfig(instances=1))
    triton_cfg = TritonServerConfig(
        repo,
        grpc_port=free_port(),
        http_port=free_port(),
        metrics_port=free_port(),
        startup_timeout_s=120,
        http=False,
        extra_args=(
            *trace_args(receiver.http_endpoint, 1.0),
            "--trace-config=opentelemetry,bsp_schedule_delay=100",
        ),
    )
    traced = ["--otlp-endpoint", receiver.grpc_endpoint, "--trace-sample-ratio", "1"]
    shard_settings = {"otlp-endpoint": receiver.grpc_endpoint, "trace-sample-ratio": "1"}
    old = {k: os.environ.get(k) for k in FAST_EXPORT}
    os.environ.update(FAST_EXPORT)  # the shard processes take the test's environment
    try:
        with (
            run_triton(triton_cfg, work / "triton.log") as triton,
            run_shards(index_dir, module_redis, work, shards=2, settings=shard_settings) as shards,
        ):
            checkpoint = tiny_checkpoint(work / "celi")
            rerank = _start(
                "rerank",
                "services.rerank.serve.server",
                ["--checkpoint", str(checkpoint), "--threads", "1", *traced],
                work,
            )
            metrics_port, http_port = free_port(), free_port()
            try:
                gateway = _start(
                    "gateway",
                    "services.gateway.server",
                    [
                        "--redis-url",
                        module_redis,
                        "--shards",
                        ";".join(",".join(r) for r in shards.addresses),
                        "--encoder",
                        "triton",
                        "--triton-url",
                        triton.grpc_url,
                        "--rerank-url",
                        rerank.address,
                        "--no-auth",
                        "--metrics-port",
                        str(metrics_port),
                        "--http-port",
                        str(http_port),
                        *traced,
                    ],
                    work,
                )
                try:
                    yield Stack(
                        receiver,
                        gateway,
                        http_port,
                        metrics_port,
                        shards,
                        triton,
                        rerank,
                        module_redis,
                        work,
                    )
                finally:
                    gateway.stop()
            finally:
                rerank.stop()
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _client_span() -> tuple[str, str, tuple[tuple[str, str], ...]]:
    """A client's own trace and span id, and the metadata that carries them."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, (("traceparent", f"00-{trace_id}-{span_id}-01"),)


def _one(spans: list[Received], service: str, name: str) -> Received:
    found = [s for s in spans if s.service == service and s.name == name]
    assert len(found) == 1, f"{service} {name}: {len(found)} spans"
    return found[0]


def _upsert(stack: Stack) -> tuple[str, str, dict[int, str]]:
    trace_id, span_id, metadata = _client_span()
    with grpc.insecure_channel(stack.gateway.address) as channel:
        reply = documents_pb2_grpc.DocumentServiceStub(channel).Upsert(
            documents_pb2.UpsertRequest(documents=DOCS), timeout=60, metadata=metadata
        )
    assert reply.upserted == len(DOCS)
    return trace_id, span_id, {p.shard: p.position for p in reply.write_token.positions}


@pytest.fixture(scope="module")
def written(stack: Stack) -> tuple[str, str, dict[int, str]]:
    return _upsert(stack)


def test_an_upsert_is_one_trace_and_its_log_entries_are_named_by_the_shards_applies(
    stack: Stack, written: tuple[str, str, dict[int, str]]
) -> None:
    trace_id, client_span, positions = written
    entries = {f"{shard}:{position}" for shard, position in positions.items()}
    names = {"retrieval.v1.DocumentService/Upsert", "encode", "triton infer"}
    stack.receiver.wait(
        lambda r: names | {"redis upsert script"} <= {s.name for s in r.trace(trace_id)},
        "the upsert's spans",
    )
    spans = stack.receiver.trace(trace_id)
    root = _one(spans, "gtr-gateway", "retrieval.v1.DocumentService/Upsert")
    assert root.parent == client_span
    script = _one(spans, "gtr-gateway", "redis upsert script")
    assert set(script.attributes["gtr.log.entries"].split(",")) == entries

    def applied(r: Receiver) -> set[str]:
        named = set()
        for s in r.matching(lambda s: s.name == "log apply"):
            named |= set(str(s.attributes.get("gtr.log.entries", "")).split(","))
        return named

    stack.receiver.wait(lambda r: entries <= applied(r), "the shards' log apply spans")


def test_a_search_is_one_trace_through_every_process_it_crossed(
    stack: Stack, written: tuple[str, str, dict[int, str]]
) -> None:
    trace_id, client_span, metadata = _client_span()
    request = search_pb2.SearchRequest(
        query="read json file",
        k=3,
        rerank=search_pb2.RerankOptions(enabled=True, depth=5),
    )
    with grpc.insecure_channel(stack.gateway.address) as channel:
        reply = search_pb2_grpc.SearchServiceStub(channel).Search(
            request, timeout=60, metadata=metadata
        )
    assert reply.hits and reply.reranked

    wanted = {
        ("gtr-gateway", "retrieval.v1.SearchService/Search"),
        ("gtr-gateway", "document fetch"),
        ("gtr-gateway", "fusion"),
        ("gtr-rerank", "retrieval.v1.RerankService/Rerank"),
        ("triton", "InferRequest"),
    }

    def complete(r: Receiver) -> bool:
        spans = r.trace(trace_id)
        shards = {s.instance for s in spans if s.name.endswith("SearchStream search")}
        return wanted <= {(s.service, s.name) for s in spans} and len(shards) == 2

    stack.receiver.wait(complete, "the search's spans from every process")
    spans = stack.receiver.trace(trace_id)
    by_id = {s.span_id: s for s in spans}
    assert {s.trace_id for s in spans} == {trace_id}
    assert {s.service for s in spans} == {"gtr-gateway", "gtr-index-shard", "gtr-rerank", "triton"}

    root = _one(spans, "gtr-gateway", "retrieval.v1.SearchService/Search")
    assert root.parent == client_span
    assert root.attributes["rpc.grpc.status_code"] == 0

    def parent_of(span: Received) -> Received:
        return by_id[span.parent]

    # Triton's request span is the child of the gateway's call to it
    infer = _one(spans, "triton", "InferRequest")
    assert parent_of(infer).name == "triton infer"
    # each shard's search is the child of the gateway's call to that shard
    shard_calls = [s for s in spans if s.service == "gtr-gateway" and s.name == "shard search"]
    assert sorted(s.attributes["gtr.shard"] for s in shard_calls) == [0, 1]
    served = [s for s in spans if s.name.endswith("SearchStream search")]
    assert {parent_of(s).span_id for s in served} == {s.span_id for s in shard_calls}
    for part in ("dense search (IVF-PQ)", "BM25 search (Tantivy)"):
        done = [s for s in spans if s.name == part]
        assert {s.parent for s in done} == {s.span_id for s in served}, part
    # the reranker's span is the child of the gateway's rerank call
    rerank = _one(spans, "gtr-rerank", "retrieval.v1.RerankService/Rerank")
    assert parent_of(rerank).name == "rerank"
    fetch = _one(spans, "gtr-gateway", "document fetch")
    assert fetch.attributes["db.system"] == "redis"
    # every gateway span hangs under the root (one tree, no stray trace)
    for span in spans:
        if span.service == "gtr-gateway" and span is not root:
            while span.parent in by_id:
                span = by_id[span.parent]
            assert span is root, span.name

    # the gateway's search latency keeps the trace id as an exemplar (OpenMetrics)
    url = f"http://127.0.0.1:{stack.metrics_port}/metrics"
    ask = urllib.request.Request(url, headers={"Accept": "application/openmetrics-text"})
    with urllib.request.urlopen(ask, timeout=10) as response:
        text = response.read().decode()
    assert f'trace_id="{trace_id}"' in text


def test_an_http_search_is_one_trace_under_the_callers_traceparent_header(
    stack: Stack, written: tuple[str, str, dict[int, str]]
) -> None:
    trace_id, client_span, ((_, traceparent),) = _client_span()
    ask = urllib.request.Request(
        f"http://127.0.0.1:{stack.http_port}/v1/search",
        data=json.dumps({"query": "read json file", "k": 3}).encode(),
        headers={"Content-Type": "application/json", "Traceparent": traceparent},
        method="POST",
    )
    with urllib.request.urlopen(ask, timeout=60) as response:
        assert json.loads(response.read())["hits"]

    def complete(r: Receiver) -> bool:
        spans = r.trace(trace_id)
        root = [s for s in spans if s.name == "retrieval.v1.SearchService/Search"]
        shards = {s.instance for s in spans if s.name.endswith("SearchStream search")}
        return bool(root) and len(shards) == 2

    stack.receiver.wait(complete, "the HTTP search's spans from the gateway and both shards")
    spans = stack.receiver.trace(trace_id)
    by_id = {s.span_id: s for s in spans}
    root = _one(spans, "gtr-gateway", "retrieval.v1.SearchService/Search")
    assert root.parent == client_span
    assert root.kind == 2  # OTLP's SPAN_KIND_SERVER
    assert root.attributes["transport"] == "http"
    served = [s for s in spans if s.name.endswith("SearchStream search")]
    assert {s.service for s in served} == {"gtr-index-shard"}
    for span in served:  # each shard's search reaches the HTTP request's span
        while span.parent in by_id:
            span = by_id[span.parent]
        assert span is root


def test_a_callers_mistake_over_http_is_not_an_error_on_the_server_span(
    stack: Stack, written: tuple[str, str, dict[int, str]]
) -> None:
    # HTTP's conventions for a SERVER span: a 4xx is the caller's mistake, left out of the
    # error status (the gRPC port's span marks only the server's faults the same way)
    asks = {
        "retrieval.v1.SearchService/Search": (
            "/v1/search",
            json.dumps({"query": "read json file", "k": 100_000}).encode(),
            400,
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        "retrieval.v1.DocumentService/Get": (
            "/v1/documents/no-such-document",
            None,
            404,
            grpc.StatusCode.NOT_FOUND,
        ),
    }
    traces = {}
    for name, (path, body, status, _) in asks.items():
        trace_id, _, ((_, traceparent),) = _client_span()
        traces[name] = trace_id
        ask = urllib.request.Request(
            f"http://127.0.0.1:{stack.http_port}{path}",
            data=body,
            headers={"Content-Type": "application/json", "Traceparent": traceparent},
            method="POST" if body else "GET",
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(ask, timeout=60)
        assert refused.value.code == status, refused.value.read()
    # the same mistake over gRPC, for the two ports' spans to compare
    grpc_trace, _, metadata = _client_span()
    with grpc.insecure_channel(stack.gateway.address) as channel:
        with pytest.raises(grpc.RpcError) as failed:
            search_pb2_grpc.SearchServiceStub(channel).Search(
                search_pb2.SearchRequest(query="read json file", k=100_000),
                timeout=60,
                metadata=metadata,
            )
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    every = [*traces.values(), grpc_trace]
    stack.receiver.wait(lambda r: all(r.trace(t) for t in every), "the refused calls' SERVER spans")
    for name, (_, _, status, code) in asks.items():
        span = _one(stack.receiver.trace(traces[name]), "gtr-gateway", name)
        assert span.status != 2, f"{name}: a {status} marked the span ERROR"
        assert span.attributes["transport"] == "http"
        assert span.attributes["http.response.status_code"] == status
        assert span.attributes["rpc.grpc.status_code"] == code.value[0]
    over_grpc = _one(
        stack.receiver.trace(grpc_trace), "gtr-gateway", "retrieval.v1.SearchService/Search"
    )
    over_http = _one(
        stack.receiver.trace(traces["retrieval.v1.SearchService/Search"]),
        "gtr-gateway",
        "retrieval.v1.SearchService/Search",
    )
    assert over_http.status == over_grpc.status == 1  # OK on both ports


def test_a_gateway_without_tracing_exports_nothing_and_passes_no_context_on(
    stack: Stack, written: tuple[str, str, dict[int, str]]
) -> None:
    untraced = _start(
        "untraced-gateway",
        "services.gateway.server",
        [
            "--redis-url",
            stack.redis_url,
            "--shards",
            ";".join(",".join(r) for r in stack.shards.addresses),
            "--encoder",
            "triton",
            "--triton-url",
            stack.triton.grpc_url,
            "--no-auth",
        ],
        stack.work,
    )
    try:
        off_trace, _, off_metadata = _client_span()
        with grpc.insecure_channel(untraced.address) as channel:
            reply = search_pb2_grpc.SearchServiceStub(channel).Search(
                search_pb2.SearchRequest(
                    query="read json file", k=3, mode=search_pb2.RETRIEVAL_MODE_SPARSE
                ),
                timeout=60,
                metadata=off_metadata,
            )
        assert reply.hits
    finally:
        untraced.stop()
    # a traced search after it: once its spans are in, every exporter has sent what the
    # untraced one's search made (the shards flush every 100 ms)
    on_trace, _, on_metadata = _client_span()
    with grpc.insecure_channel(stack.gateway.address) as channel:
        search_pb2_grpc.SearchServiceStub(channel).Search(
            search_pb2.SearchRequest(
                query="read json file", k=3, mode=search_pb2.RETRIEVAL_MODE_SPARSE
            ),
            timeout=60,
            metadata=on_metadata,
        )
    stack.receiver.wait(
        lambda r: (
            len({s.instance for s in r.trace(on_trace) if s.service == "gtr-index-shard"}) == 2
        ),
        "the traced search's shard spans",
    )
    assert stack.receiver.trace(off_trace) == []
    # the untraced gateway made no span, and its shard searches came with no context:
    # the shards (traced) started traces of their own, with no parent
    roots = stack.receiver.matching(
        lambda s: s.name.endswith("SearchStream search") and s.parent == ""
    )
    assert len(roots) == 2
