"""bench.hop_free's workers: the floor's search path served over gRPC by processes that
share one port (issue #34's hop-free upper bound), driven as the sweep drives them."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from bench import floor as floor_bench
from bench.hop_free import hop_free_servers
from retrieval.v1 import search_pb2, search_pb2_grpc
from tests.support.local_stack import small_corpus

pytestmark = pytest.mark.slow

HYBRID = search_pb2.RETRIEVAL_MODE_HYBRID
DENSE = search_pb2.RETRIEVAL_MODE_DENSE


def test_workers_on_one_port_answer_each_connection_with_the_floors_search(
    tmp_path: Path,
) -> None:
    corpus = tmp_path / "corpus.jsonl"
    ids = small_corpus(floor_bench.SCIFACT, corpus, 240, text_chars=120)  # short: quick to embed
    titles = {}
    for line in corpus.read_text(encoding="utf-8").splitlines():
        doc = json.loads(line)
        titles[doc["_id"]] = doc["title"]
    wanted = ids[:6]
    with hop_free_servers(corpus, tmp_path / "workers", 2, "fp32") as address:
        for n in range(6):  # a connection of its own each: the kernel picks its worker
            options = [("grpc.use_local_subchannel_pool", 1)]
            with grpc.insecure_channel(address, options=options) as channel:
                stub = search_pb2_grpc.SearchServiceStub(channel)
                doc_id = wanted[n]
                for mode in (HYBRID, DENSE):
                    asked = search_pb2.SearchRequest(query=titles[doc_id], k=5, mode=mode)
                    hits = stub.Search(asked, timeout=30).hits
                    assert len(hits) == 5
                    # a document's own title finds it, in either mode
                    assert doc_id in [h.id for h in hits], (mode, titles[doc_id])
