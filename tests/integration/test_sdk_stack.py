"""The SDK against a real stack (one for the module): a real redis-server, two real shard
servers and the gateway (the in-process MiniLM encoder) on an event loop of their own,
the gateway with bearer tokens, mutual TLS and a small in-flight limit, as a deployment
runs it. The SDK talks to it as a user's program does, sync and asyncio.

- round trips: upsert, search (typed hits: scores, documents, ranks, timings, mode,
  generation), batch search, get, delete;
- a session reads its writes: its searches send its write token, so one given a token
  the shards cannot reach yet waits for it (partial at the deadline) where the client
  answers at once;
- every bad call raises its typed exception (INVALID_ARGUMENT, NOT_FOUND,
  UNAUTHENTICATED, PERMISSION_DENIED, DEADLINE_EXCEEDED, UNAVAILABLE), and a refusal over
  the limit RESOURCE_EXHAUSTED with the gateway's hint, which the retrying client waits
  before it is admitted once room frees;
- the token and TLS come from the environment variables the CLI reads, and the README's
  SDK example runs unchanged against this gateway.
"""

from __future__ import annotations

import asyncio
import logging
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

import gtr_client
from gtr_client import Document, Mode, Query, WriteToken
from services.stack.certs import CertFiles, make_certs
from tests.support.background import BackgroundStack, stack_in_background
from tests.support.log_end import FUTURE, log_end_moved
from tests.support.processes import free_port, pythonpath, wait_until
from tests.support.sample_docs import STDLIB_DOCS
from tests.support.shards import scifact_vectors, shared_test_index

REDIS_DB = 14  # module_redis: the stack outlives the per-test flush of db 0
ROOT = Path(__file__).resolve().parents[2]
READ, WRITE = "sdk-test-read-token", "sdk-test-write-token"
LIMIT = 4  # the gateway's --max-in-flight
HINT_MS = 500  # its --retry-after-ms
DOCS = [Document(i, text, title=title, metadata={"lang": "py"}) for i, title, text in STDLIB_DOCS]


@dataclass
class Stack:
    bg: BackgroundStack
    redis_url: str
    certs: CertFiles

    @property
    def address(self) -> str:
        return self.bg.address

    @property
    def tls(self) -> gtr_client.TLS:
        c = self.certs
        return gtr_client.TLS(c.ca, c.client_cert, c.client_key)

    def client(self, token: str | None = WRITE, **options: object) -> gtr_client.Client:
        return gtr_client.Client(
            self.address,
            token=token or "",
            tls=self.tls,
            env=False,
            **options,  # type: ignore[arg-type]
        )

    def aio(self, token: str = WRITE) -> gtr_client.AsyncClient:
        return gtr_client.AsyncClient(self.address, token=token, tls=self.tls, env=False)

    @property
    def in_flight(self) -> int:
        return self.bg.stack.gateway.server.admission.in_flight

    def handled(self, method: str, code: str) -> float:
        labels = {"service": "gateway", "method": method, "code": code, "transport": "grpc"}
        registry = self.bg.stack.gateway.registry
        return float(registry.get_sample_value("grpc_server_handled_total", labels) or 0.0)


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, module_redis: str, scifact_dir: Path
) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("sdk")
    index_dir = shared_test_index(tmp_path_factory.getbasetemp(), scifact_vectors(scifact_dir))
    certs = make_certs(tmp / "certs")
    (tmp / "read.tokens").write_text(f"{READ}\n")
    (tmp / "write.tokens").write_text(f"{WRITE}\n")
    settings: dict[str, object] = {
        "auth": True,
        "read_tokens_file": str(tmp / "read.tokens"),
        "write_tokens_file": str(tmp / "write.tokens"),
        "tls_cert": str(certs.server_cert),
        "tls_key": str(certs.server_key),
        "tls_client_ca": str(certs.ca),
        "max_in_flight": LIMIT,
        "retry_after_ms": HINT_MS,
        "client_share": 1.0,  # one token here holds every call: no per-client share
    }
    with stack_in_background(module_redis, index_dir, tmp, gateway_settings=settings) as bg:
        s = Stack(bg, module_redis, certs)
        with s.client() as client:
            assert client.upsert(DOCS).upserted == len(DOCS)
        yield s


def test_a_session_writes_reads_its_writes_and_gets_typed_results(stack: Stack) -> None:
    doc = Document(
        "sdk-zlib", "Compress and decompress data with zlib.", "zlib", {"lang": "py", "v": "1"}
    )
    with stack.client() as client:
        session = client.session()
        up = session.upsert([doc])
        assert up.upserted == 1 and up.truncated == 0 and up.write_token.positions
        assert session.write_token == up.write_token

        result = session.search("compress data with zlib", k=3, filter={"v": "1"})
        assert isinstance(result, gtr_client.SearchResult) and not result.partial
        (hit,) = result.hits
        assert isinstance(hit, gtr_client.Hit)
        assert (hit.id, hit.title, hit.text, dict(hit.metadata)) == (
            doc.id,
            doc.title,
            doc.text,
            dict(doc.metadata),
        )
        assert result.mode is Mode.HYBRID and result.fusion is not None  # the default
        assert hit.dense_rank == 1 and hit.sparse_rank == 1
        assert hit.score == hit.first_stage_score and not result.reranked
        assert result.model == "all-MiniLM-L6-v2" and result.generation
        assert result.timings.total_ms > 0 and result.timings.encode_ms > 0

        assert client.get(doc.id) == doc
        gone = session.delete([doc.id, "sdk-never-written"])
        assert (gone.deleted, gone.not_found) == (1, ("sdk-never-written",))
        after = session.search("compress data with zlib", k=3, filter={"v": "1"})
        assert after.ids == [], "a session reads its own delete"
        with pytest.raises(gtr_client.NotFound):
            client.get(doc.id)


def test_a_sessions_searches_wait_for_its_token_where_the_client_does_not(stack: Stack) -> None:
    """The session sends SESSION consistency with its token on its own: given a token
    whose position shard 0 has not reached (its log's end moved there, no entry ever
    applied), its search waits for it until the deadline, answered without shard 0; the
    client's own search (EVENTUAL) answers at once with both shards."""
    with stack.client() as client:
        written = client.upsert(DOCS[:1]).write_token
        ahead = WriteToken({0: FUTURE}, written.generation, written.epoch)
        with log_end_moved(stack.redis_url, [0]):
            assert not client.search("csv rows", k=2, timeout=10).partial
            result = client.session(ahead).search("csv rows", k=2, timeout=1.5)
            assert result.partial and result.missing_shards == (0,), result


def test_a_batch_answers_each_query_with_its_own_options(stack: Stack) -> None:
    with stack.client() as client:
        sparse, dense, default = client.batch_search(
            [
                Query("json document", k=2, mode=Mode.SPARSE),
                Query("pool of threads", k=2, mode=Mode.DENSE, ids_only=True),
                "sha256 hash",
            ]
        )
    assert sparse.mode is Mode.SPARSE and sparse.model is None and sparse.ids[0] == "py-json"
    assert sparse.hits[0].sparse_rank == 1 and sparse.hits[0].dense_rank is None
    assert dense.mode is Mode.DENSE and dense.ids[0] == "py-thread"
    assert all(h.dense_rank is None and not h.text for h in dense)  # ids_only
    assert default.mode is Mode.HYBRID and default.ids[0] == "py-hash" and len(default) <= 10


def test_the_asyncio_client_does_the_same_round_trip(stack: Stack) -> None:
    doc = Document("sdk-async", "Schedule coroutines on an event loop.", "asyncio")

    async def scenario() -> None:
        async with stack.aio() as client:
            assert await client.health() is gtr_client.HealthStatus.SERVING
            session = client.session()
            assert (await session.upsert([doc])).upserted == 1
            result = await session.search("event loop coroutines", k=5)
            assert doc.id in result.ids
            (batch,) = await session.batch_search([Query("event loop", k=5)])
            assert doc.id in batch.ids
            assert await client.get(doc.id) == doc
            assert (await session.delete(doc.id)).deleted == 1
            assert doc.id not in (await session.search("event loop coroutines", k=5)).ids
            with pytest.raises(gtr_client.NotFound):
                await client.get(doc.id)

    asyncio.run(scenario())


def test_each_bad_call_raises_its_typed_exception(stack: Stack) -> None:
    with stack.client() as client:
        with pytest.raises(gtr_client.InvalidArgument, match="k"):
            client.search("csv", k=0)
        with pytest.raises(gtr_client.InvalidArgument, match="fusion"):
            client.search("csv", mode="dense", fusion="rrf")
        with pytest.raises(gtr_client.InvalidArgument, match="text"):
            client.upsert([Document("sdk-empty", "")])
        with pytest.raises(gtr_client.NotFound):
            client.get("sdk-no-such-document")
        with pytest.raises(gtr_client.DeadlineExceeded):
            client.search("csv", timeout=0.0001)
    with stack.client(token=None) as anonymous, pytest.raises(gtr_client.Unauthenticated):
        anonymous.search("csv")
    with stack.client(token=READ) as reader:
        assert reader.search("csv", k=1).ids
        with pytest.raises(gtr_client.PermissionDenied):
            reader.upsert(DOCS[:1])
    nowhere = gtr_client.Client(f"127.0.0.1:{free_port()}", env=False)
    with nowhere, pytest.raises(gtr_client.Unavailable) as down:
        nowhere.search("csv", timeout=2.0)
    assert down.value.attempts > 1, "UNAVAILABLE is retried for a search"


def test_over_the_limit_a_call_is_refused_with_the_hint_and_the_retrying_client_waits_it(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    """LIMIT searches held in flight (each waits for a log position shard 0 never
    reaches, until its 1.5 s deadline): a client that does not retry gets
    ResourceExhausted with the gateway's hint; a retrying one is refused, waits the hint
    (never less) between attempts, and is answered once the held searches have ended."""
    held_token = WriteToken({0: FUTURE})
    with (
        log_end_moved(stack.redis_url, [0]),
        stack.client(retry=gtr_client.NO_RETRY) as holder,
        ThreadPoolExecutor(LIMIT) as pool,
    ):
        before = stack.handled("Search", "RESOURCE_EXHAUSTED")
        held = [
            pool.submit(holder.search, f"held {i}", k=1, write_token=held_token, timeout=1.5)
            for i in range(LIMIT)
        ]
        wait_until(lambda: stack.in_flight == LIMIT, f"{LIMIT} searches in flight", 10, 0.01)
        with pytest.raises(gtr_client.ResourceExhausted) as refused:
            holder.search("csv", k=1)
        assert refused.value.retry_after_s == HINT_MS / 1000 and refused.value.attempts == 1

        caplog.set_level(logging.DEBUG, logger="gtr_client")
        with stack.client(retry=gtr_client.RetryPolicy(attempts=10)) as patient:
            assert patient.search("csv rows", k=1, timeout=30).ids == ["py-csv"]
        for future in held:
            future.exception()  # ended: partial or DEADLINE_EXCEEDED, either is fine
    pauses = [float(m) for m in re.findall(r"in (\d+\.\d+) s", caplog.text)]
    assert pauses and all(p >= HINT_MS / 1000 for p in pauses), caplog.text
    wait_until(
        lambda: stack.handled("Search", "RESOURCE_EXHAUSTED") - before >= 1 + len(pauses),
        "the gateway counted every refusal",
    )


def test_the_token_and_tls_come_from_the_clis_environment_variables(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in _env(stack, READ).items():
        monkeypatch.setenv(name, value)
    with gtr_client.Client() as client:
        assert client.address == stack.address
        assert client.health() is gtr_client.HealthStatus.SERVING
        assert client.search("csv", k=1).ids
        with pytest.raises(gtr_client.PermissionDenied):  # the read token of $GTR_TOKEN
            client.delete("py-csv")
    with gtr_client.Client(token=WRITE) as writer:  # an argument wins over its variable
        assert writer.upsert(DOCS[:1]).upserted == 1


def test_the_readmes_sdk_example_runs_against_the_gateway(stack: Stack) -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    example = re.search(r"<!-- sdk-example -->\s*```python\n(.*?)```", readme, re.S)
    assert example, "the README's SDK example (after <!-- sdk-example -->)"
    done = subprocess.run(
        [sys.executable, "-c", example.group(1)],
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": pythonpath(ROOT), **_env(stack, WRITE)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "my-note" in done.stdout, done.stdout


def _env(stack: Stack, token: str) -> dict[str, str]:
    c = stack.certs
    return {
        "GTR_GATEWAY_ADDRESS": stack.address,
        "GTR_TOKEN": token,
        "GTR_TLS_CA": str(c.ca),
        "GTR_TLS_CLIENT_CERT": str(c.client_cert),
        "GTR_TLS_CLIENT_KEY": str(c.client_key),
    }
