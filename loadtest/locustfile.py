"""Locust file for teams that use Locust: the gateway's Search and BatchSearch over gRPC.

    .venv/bin/locust -f loadtest/locustfile.py --headless -u 2 -r 2 -t 5s --host 127.0.0.1:50051
    .venv/bin/locust -f loadtest/locustfile.py --host 127.0.0.1:50051 --gtr-rerank   # web UI

``--host`` is the gateway's host:port (no scheme). Each Locust user sends one request at
a time at most ``--gtr-rate`` per second (``constant_throughput``): Locust is a closed
loop, so when the gateway slows down the users slow down with it and the percentiles it
shows leave out the requests that were never sent (coordinated omission). For latency
figures under a given arrival rate use ``python -m loadtest.openloop``; this file is for
dashboards and scenarios built in Locust. A search answered without every shard is
reported under the name ``Search [partial]``. Options (after the Locust ones):
``--gtr-token`` (default ``$GTR_TOKEN``), ``--gtr-tls-ca``, ``--gtr-queries`` (a BEIR
queries.jsonl), ``--gtr-k``, ``--gtr-rerank``, ``--gtr-batch-size``, ``--gtr-rate``.

This module patches gRPC for gevent when Locust loads it (it is an entry point, run by
``locust -f``; nothing else imports it, and pytest does not collect it).
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any

import grpc
import grpc.experimental.gevent as grpc_gevent
from locust import User, constant_throughput, events, task

from loadtest.target import Target
from loadtest.workload import load_queries
from retrieval.v1 import search_pb2, search_pb2_grpc

grpc_gevent.init_gevent()  # gRPC's C core must yield to gevent's hub


@events.init_command_line_parser.add_listener
def _options(parser: Any) -> None:
    parser.add_argument("--gtr-token", default=os.environ.get("GTR_TOKEN", ""), help="bearer")
    parser.add_argument("--gtr-tls-ca", default="", help="CA bundle: use TLS")
    parser.add_argument("--gtr-queries", default="", help="BEIR queries.jsonl")
    parser.add_argument("--gtr-k", type=int, default=10)
    parser.add_argument("--gtr-rerank", action="store_true", help="ask for the rerank")
    parser.add_argument("--gtr-batch-size", type=int, default=8, help="queries per BatchSearch")
    parser.add_argument("--gtr-rate", type=float, default=10.0, help="requests/s per user")


class GatewayUser(User):
    """One gRPC channel per user; Search 9 times out of 10, else a BatchSearch."""

    pacing = staticmethod(constant_throughput(10.0))  # --gtr-rate replaces it in on_start

    def wait_time(self) -> float:
        return float(self.pacing(self))

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        if opts is not None:
            self.pacing = constant_throughput(float(opts.gtr_rate))
        self.target = Target(
            self.host or "127.0.0.1:50051",
            token=(opts.gtr_token if opts else "") or None,
            tls_ca=Path(opts.gtr_tls_ca) if opts and opts.gtr_tls_ca else None,
        )
        self.queries = load_queries(Path(opts.gtr_queries) if opts and opts.gtr_queries else None)
        self.k = int(opts.gtr_k) if opts else 10
        self.rerank = bool(opts.gtr_rerank) if opts else False
        self.batch_size = int(opts.gtr_batch_size) if opts else 8
        self.channel = self.target.sync_channel()
        self.stub = search_pb2_grpc.SearchServiceStub(self.channel)

    def on_stop(self) -> None:
        self.channel.close()

    def _request(self) -> search_pb2.SearchRequest:
        return search_pb2.SearchRequest(
            query=random.choice(self.queries),
            k=self.k,
            rerank=search_pb2.RerankOptions(enabled=self.rerank),
        )

    def _call(self, name: str, method: Any, request: Any) -> None:
        began = time.perf_counter()
        error: Exception | None = None
        length = 0
        partial = False
        try:
            reply = method(request, timeout=10.0, metadata=self.target.metadata or None)
            length = reply.ByteSize()
            responses = getattr(reply, "responses", None)
            partial = any(r.partial for r in responses) if responses else bool(reply.partial)
        except grpc.RpcError as exc:
            error = exc
        self.environment.events.request.fire(
            request_type="grpc",
            name=f"{name} [partial]" if partial else name,
            response_time=(time.perf_counter() - began) * 1000.0,
            response_length=length,
            exception=error,
            context={},
        )

    @task(9)
    def search(self) -> None:
        self._call("Search", self.stub.Search, self._request())

    @task(1)
    def batch_search(self) -> None:
        batch = [self._request() for _ in range(self.batch_size)]
        request = search_pb2.BatchSearchRequest(requests=batch)
        self._call("BatchSearch", self.stub.BatchSearch, request)
