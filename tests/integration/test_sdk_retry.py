"""The SDK's retries over real sockets (gtr_client/retry.py): a real gRPC server that
fails a method on cue (tests/support/scripted.py) stands for a gateway that is busy or
restarting; the real gateway's refusal and hint are tested in test_sdk_stack.py and
test_gateway_front_door.py.

- a refusal with ``retry-after-ms`` is sent again, a write too, and never sooner than
  the hint (the attempts' arrival times at the server);
- UNAVAILABLE is sent again for an Upsert, never for a Delete;
- a bad request, or a hint that outlasts the deadline, is raised at once, typed;
- the asyncio client does the same.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

import gtr_client
from retrieval.v1 import documents_pb2, search_pb2
from tests.support.scripted import Script, scripted_server

DOCS = "retrieval.v1.DocumentService"
HINT = (("retry-after-ms", "300"), ("grpc-retry-pushback-ms", "300"))


def _client(address: str) -> gtr_client.Client:
    return gtr_client.Client(address, env=False)


def _gaps(script: Script) -> list[float]:
    return [b - a for a, b in zip(script.arrivals, script.arrivals[1:], strict=False)]


def test_a_refused_delete_is_sent_again_after_the_servers_hint_never_sooner() -> None:
    """The gateway refuses over its limit before any work, so even a Delete is safe to
    send again: after 300 ms each time (the SDK's own backoff would be 0.1 s)."""
    reply = documents_pb2.DeleteResponse(deleted=1).SerializeToString()
    script = Script(grpc.StatusCode.RESOURCE_EXHAUSTED, failures=2, reply=reply, trailing=HINT)
    with scripted_server(DOCS, "Delete", script) as address, _client(address) as client:
        assert client.delete("a", timeout=10).deleted == 1
    assert script.attempts == 3
    assert all(gap >= 0.3 for gap in _gaps(script)), _gaps(script)


def test_unavailable_sends_an_upsert_again_but_never_a_delete() -> None:
    reply = documents_pb2.UpsertResponse(upserted=1).SerializeToString()
    upsert = Script(grpc.StatusCode.UNAVAILABLE, failures=2, reply=reply)
    # a document over gRPC's default 256 KiB retry buffer: the SDK resends it itself
    doc = gtr_client.Document("a", "x" * 1_000_000)
    with scripted_server(DOCS, "Upsert", upsert) as address, _client(address) as client:
        assert client.upsert([doc], timeout=10).upserted == 1
    assert upsert.attempts == 3

    delete = Script(grpc.StatusCode.UNAVAILABLE, failures=1)
    with scripted_server(DOCS, "Delete", delete) as address, _client(address) as client:
        with pytest.raises(gtr_client.Unavailable) as down:
            client.delete(["a"], timeout=10)
    assert delete.attempts == 1 and down.value.attempts == 1 and down.value.method == "Delete"


def test_a_bad_request_is_raised_at_once_as_its_exception() -> None:
    script = Script(grpc.StatusCode.INVALID_ARGUMENT, failures=100)
    with scripted_server(DOCS, "Get", script) as address, _client(address) as client:
        with pytest.raises(gtr_client.InvalidArgument, match="scripted failure 1"):
            client.get("a")
    assert script.attempts == 1


def test_a_hint_that_outlasts_the_deadline_is_raised_at_once_with_the_hint() -> None:
    """Told "retry after 5 s" with 1 s left, the SDK does not wait the deadline out into
    DEADLINE_EXCEEDED: the caller gets the refusal and its hint now."""
    later = (("retry-after-ms", "5000"),)
    script = Script(grpc.StatusCode.RESOURCE_EXHAUSTED, failures=100, trailing=later)
    with scripted_server(DOCS, "Get", script) as address, _client(address) as client:
        with pytest.raises(gtr_client.ResourceExhausted) as busy:
            client.get("a", timeout=1.0)
    assert busy.value.retry_after_s == 5.0 and busy.value.attempts == 1
    assert script.attempts == 1


def test_the_asyncio_client_waits_the_hint_too() -> None:
    answer = search_pb2.SearchResponse(hits=[search_pb2.Hit(id="d1", score=0.5)])
    script = Script(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        failures=1,
        reply=answer.SerializeToString(),
        trailing=HINT,
    )

    async def search(address: str) -> gtr_client.SearchResult:
        async with gtr_client.AsyncClient(address, env=False) as client:
            return await client.search("q", timeout=10)

    with scripted_server("retrieval.v1.SearchService", "Search", script) as address:
        result = asyncio.run(search(address))
    assert result.ids == ["d1"] and script.attempts == 2
    assert _gaps(script)[0] >= 0.3
