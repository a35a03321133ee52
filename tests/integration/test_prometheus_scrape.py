"""A real Prometheus (Debian's binary) scrapes real gateway and shard servers, and the
recording rules of deploy/prometheus/rules.yml return values for the traffic the test
sends.

The Prometheus config is the local stack's (deploy/prometheus/prometheus.yml: file_sd
targets.json, rules.yml) with 1 s scrape and evaluation intervals, so that the test is
bounded; every wait polls Prometheus's HTTP API for a condition. The services are the
test stack of tests/support/background.py (real Redis, two real shard servers, the
gateway with the in-process MiniLM encoder), their registries served over HTTP as the
processes serve them.

What it shows, besides that the rules' metric and label names are the ones the services
export: Search requests that fail count as misses of the search SLO (only failing
traffic: the SLI is exactly 1, not absent), requests refused for the caller's mistake
do not count, and the partial-results ratio is per query over per query (BatchSearch
queries included: exactly 1 when every answered query is partial).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from prometheus_client import start_http_server

from retrieval.v1 import documents_pb2, documents_pb2_grpc, search_pb2, search_pb2_grpc
from tests.support.background import BackgroundStack, stack_in_background
from tests.support.processes import free_port, run_redis, wait_until
from tests.support.sample_docs import STDLIB_DOCS
from tests.support.shards import scifact_vectors, shared_test_index

# Slow as a whole: a real Prometheus scrapes a stack until the series appear.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "deploy" / "prometheus"
DOCS = [
    *STDLIB_DOCS,
    ("py-re", "re.compile", "Compile a regular expression pattern into a pattern object."),
    ("py-os", "os.listdir", "Return a list of the entries in the directory given by path."),
]
QUERIES = ["read a csv file", "parse json", "hash some bytes", "run in threads"]


@dataclass
class Prometheus:
    url: str

    def query(self, expr: str) -> list[dict[str, Any]]:
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as reply:
            body = json.loads(reply.read())
        assert body["status"] == "success", body
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def values(self, expr: str) -> list[float]:
        return [float(r["value"][1]) for r in self.query(expr)]

    def await_values(
        self, expr: str, condition: Callable[[list[float]], bool], timeout: float = 60.0
    ) -> list[float]:
        deadline = time.monotonic() + timeout
        while True:
            got = self.values(expr)
            if condition(got):
                return got
            if time.monotonic() > deadline:
                raise AssertionError(f"{expr}: {got} after {timeout:.0f} s")
            time.sleep(0.2)


def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        pytest.fail("prometheus is not installed (scripts/bootstrap.sh installs it)")
    return path


@dataclass
class Scraped:
    bg: BackgroundStack
    prometheus: Prometheus
    channel: grpc.Channel

    def encode_calls(self) -> float:
        """The gateway's gtr_encode_calls_total, read from its registry."""
        return sum(
            sample.value
            for family in self.bg.stack.gateway.registry.collect()
            for sample in family.samples
            if sample.name == "gtr_encode_calls_total"
        )

    def search(
        self, query: str, timeout: float = 30.0, **fields: Any
    ) -> search_pb2.SearchResponse | grpc.StatusCode:
        """A Search; its status code when it fails."""
        stub = search_pb2_grpc.SearchServiceStub(self.channel)
        try:
            reply: search_pb2.SearchResponse = stub.Search(
                search_pb2.SearchRequest(query=query, k=3, **fields), timeout=timeout
            )
        except grpc.RpcError as exc:
            code: grpc.StatusCode = exc.code()
            return code
        return reply


def await_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"prometheus exited:\n{log.read_text(errors='replace')[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"prometheus not ready:\n{log.read_text(errors='replace')}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory, scifact_dir: Path) -> Iterator[Scraped]:
    """The stack with six documents, its shard 1 stopped (so every search is partial or
    fails), scraped by Prometheus with the repository's config and rules."""
    binary = prometheus_binary()
    index_dir = shared_test_index(tmp_path_factory.getbasetemp(), scifact_vectors(scifact_dir))
    tmp = tmp_path_factory.mktemp("prometheus-scrape")
    with (
        run_redis(tmp / "redis") as redis_server,
        stack_in_background(redis_server.url, index_dir, tmp) as bg,
    ):
        channel = grpc.insecure_channel(bg.address)
        documents_pb2_grpc.DocumentServiceStub(channel).Upsert(
            documents_pb2.UpsertRequest(
                documents=[documents_pb2.Document(id=i, title=t, text=x) for i, t, x in DOCS]
            ),
            timeout=60,
        )
        bg.run(bg.stack.shards[1][0].server.stop(0))
        registries = [("gateway", bg.stack.gateway.registry)] + [
            ("index", replica.registry) for shard in bg.stack.shards for replica in shard
        ]
        servers = [start_http_server(0, addr="127.0.0.1", registry=r)[0] for _, r in registries]
        home = tmp / "prometheus"
        home.mkdir()
        config = yaml.safe_load((CONFIG / "prometheus.yml").read_text(encoding="utf-8"))
        config["global"]["scrape_interval"] = config["global"]["evaluation_interval"] = "1s"
        config["scrape_configs"][0]["file_sd_configs"][0]["refresh_interval"] = "1s"
        (home / "prometheus.yml").write_text(yaml.safe_dump(config), encoding="utf-8")
        shutil.copy(CONFIG / "rules.yml", home / "rules.yml")
        targets = [
            {"targets": [f"127.0.0.1:{server.server_port}"], "labels": {"job": job}}
            for (job, _), server in zip(registries, servers, strict=True)
        ]
        (home / "targets.json").write_text(json.dumps(targets), encoding="utf-8")
        port = free_port()
        log = tmp / "prometheus.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [
                    binary,
                    f"--config.file={home / 'prometheus.yml'}",
                    f"--storage.tsdb.path={tmp / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                ],
                cwd=home,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        try:
            prometheus = Prometheus(f"http://127.0.0.1:{port}")
            await_ready(prometheus.url, proc, log)
            # Every target scraped once before any search: the series the gateway creates
            # up front are known at 0, so rate() sees every search that follows.
            prometheus.await_values("up", lambda v: v == [1.0] * len(registries))
            prometheus.await_values(
                'gtr_search_seconds_count{job="gateway"}', lambda v: v == [0, 0]
            )
            yield Scraped(bg, prometheus, channel)
        finally:
            proc.terminate()
            proc.wait(30)
            for server in servers:
                server.shutdown()
                server.server_close()
            channel.close()


def test_failed_searches_are_misses_and_client_mistakes_do_not_count(scraped: Scraped) -> None:
    """Then partial answers: the partial ratio is per query over per query."""
    prom = scraped.prometheus

    def failing_wave() -> None:
        for query in QUERIES:  # shard 1 does not answer: the caller wants every shard
            assert scraped.search(query, timeout=5, require_complete=True) != grpc.StatusCode.OK
            for _ in range(4):  # no reranker on this gateway: the caller's mistake
                refused = scraped.search(query, rerank=search_pb2.RerankOptions(enabled=True))
                assert refused == grpc.StatusCode.FAILED_PRECONDITION

    # A counter series born with the first failure of its code is at its first scrape
    # already past that failure, which rate() cannot see: a first wave creates them.
    failing_wave()
    prom.await_values(
        'count(grpc_server_handled_total{job="gateway", method="Search", code!="OK"})',
        lambda v: len(v) == 1 and v[0] >= 2,
    )
    failing_wave()
    # No Search succeeded: the search SLI is 1 (all misses), not absent; the refused
    # ones are not valid events (a fifth of the failing traffic is counted).
    assert prom.await_values("gtr:search_slo_error_ratio:rate5m", lambda v: v == [1.0])
    # A fifth of the failing Searches are valid events: 0.2 in exact counts. The rule's
    # rate and this query's rate are taken at instants up to one evaluation apart, and
    # rate() extrapolates young series differently, so the share is awaited inside a band
    # that still tells the three possible rules apart: refusals counted would give 1.0,
    # failures dropped would give 0 (or no value).
    share_expr = (
        "gtr:search_requests_valid:rate5m"
        ' / on () sum(rate(grpc_server_handled_total{job="gateway", method="Search"}[5m]))'
    )
    prom.await_values(share_expr, lambda v: len(v) == 1 and 0.05 < v[0] < 0.6)
    (active,) = prom.query("gtr:encoder_size:active")
    assert active["metric"]["size"] == "base"
    # The encodes of the failed searches succeeded: the encode SLI has a value.
    (encode,) = prom.await_values("gtr:encode_slo_error_ratio:rate5m", lambda v: len(v) == 1)
    assert 0.0 <= encode <= 1.0
    assert prom.await_values(
        'gtr:grpc_server_error_ratio:rate5m{service="gateway", method="Search"}',
        lambda v: len(v) == 1 and v[0] > 0,
    )

    # Partial answers, by Search and by BatchSearch: every answered query is partial.
    # Each request calls the encoder once, a BatchSearch's batch included.
    stub = search_pb2_grpc.SearchServiceStub(scraped.channel)
    calls_before = scraped.encode_calls()
    for _ in range(2):
        for query in QUERIES:
            reply = scraped.search(query)
            assert isinstance(reply, search_pb2.SearchResponse) and reply.partial
        batch = stub.BatchSearch(
            search_pb2.BatchSearchRequest(
                requests=[search_pb2.SearchRequest(query=q, k=3) for q in QUERIES]
            ),
            timeout=30,
        )
        assert [r.partial for r in batch.responses] == [True] * len(QUERIES)
    assert scraped.encode_calls() - calls_before == 2 * (len(QUERIES) + 1)
    assert prom.await_values("gtr:search_partial_ratio:rate5m", lambda v: v == [1.0])
    # The answered Searches are good events now: the SLI falls below 1.
    prom.await_values("gtr:search_slo_error_ratio:rate5m", lambda v: len(v) == 1 and v[0] < 1)


def test_shard_log_lag_is_recorded_per_shard(scraped: Scraped) -> None:
    """Shard 1's replica stops applying (its consumer is stopped for real) and a document
    of shard 1 is written: the rule records a lag for shard 1 that grows with its age,
    while shard 0, caught up, stays at 0. A rule that lost the shard label, or took
    another series, would show the same value for both or none."""
    from services.index.core.ids import shard_of

    prom = scraped.prometheus
    prom.await_values("gtr:index_log_lag_seconds:max", lambda v: v == [0.0, 0.0])
    scraped.bg.stack.shards[1][0].replica.stop(snapshot=False)  # the consumer thread ends
    doc_id = next(f"lag-{i}" for i in range(100) if shard_of(f"lag-{i}", 2) == 1)
    documents_pb2_grpc.DocumentServiceStub(scraped.channel).Upsert(
        documents_pb2.UpsertRequest(
            documents=[documents_pb2.Document(id=doc_id, text="a write shard 1 never applies")]
        ),
        timeout=60,
    )
    written = time.monotonic()

    def by_shard() -> dict[str, float]:
        return {
            r["metric"]["shard"]: float(r["value"][1])
            for r in prom.query("gtr:index_log_lag_seconds:max")
        }

    wait_until(lambda: by_shard().get("1", 0.0) >= 2.0, "shard 1's lag recorded", timeout=60)
    first = by_shard()
    assert first["0"] == 0.0 and 2.0 <= first["1"] <= time.monotonic() - written + 2.0
    wait_until(lambda: by_shard()["1"] >= first["1"] + 2.0, "shard 1's lag grows", timeout=60)
    assert by_shard()["0"] == 0.0
