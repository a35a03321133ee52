"""Bearer tokens and TLS on every hop (issue #13 items 1 and 2), against real servers.

One real Redis, one real index shard and one real reranker, both requiring client
certificates (mTLS), and a gateway that serves TLS, checks bearer tokens from two token
files, and reaches the shard and the reranker over mTLS with its own client
certificate. Certificates come from the throwaway CA of ``services/stack/certs.py``
(a second, unrelated CA plays the impostor). The servers run in one event loop of their
own (a thread), started once for the module; the tests are clients over real sockets.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
import threading
import urllib.parse
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from retrieval.v1 import documents_pb2, documents_pb2_grpc, search_pb2, search_pb2_grpc
from services.common import errors
from services.gateway.server import Gateway, start_gateway
from services.gateway.settings import GatewaySettings
from services.index.client.router import ShardRouter
from services.index.core.query import IndexQuery
from services.index.server.process import RunningShard, start_shard
from services.rerank.serve.server import Reranker, start_rerank
from services.rerank.serve.settings import RerankSettings
from services.rpc.auth import bearer_metadata
from services.rpc.tls import ClientTLS, channel
from services.stack.certs import CertFiles, make_certs
from services.stack.config import StackConfig
from services.stack.launcher import Stack
from tests.support.http_json import HttpJson
from tests.support.local_stack import small_corpus
from tests.support.processes import RedisServer, free_port, pythonpath, redis_binary, wait_until
from tests.support.rerank import WORDS, tiny_checkpoint
from tests.support.shards import ROOT, train_test_index
from tests.support.stack import shard_settings

READ, WRITE, ROTATED = "read-token-0123456789", "write-token-9876543210", "rotated-token-42"
DOCS = [
    documents_pb2.Document(id=f"d{i:02d}", title=f"topic {i}", text=f"{WORDS[i % 10]} doc {i}")
    for i in range(12)
]
T = TypeVar("T")


class Loop:
    """An event loop in a thread of its own, for servers that outlive one test."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 300) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@dataclass
class Secured:
    loop: Loop
    gateway: Gateway
    shard: RunningShard
    reranker: Reranker
    certs: CertFiles
    other: CertFiles  # an unrelated CA and its certificates
    read_file: Path
    health_port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gateway.port}"

    @property
    def shard_address(self) -> str:
        return f"127.0.0.1:{self.shard.port}"

    def channel(self, tls: ClientTLS | None = None) -> grpc.Channel:
        return channel(self.address, tls if tls is not None else ClientTLS(self.certs.ca))


@pytest.fixture(scope="module")
def secured(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer, scifact_dir: Path
) -> Iterator[Secured]:
    import redis

    tmp = tmp_path_factory.mktemp("auth-tls")
    redis.Redis.from_url(redis_server.url).flushdb()
    certs = make_certs(tmp / "certs")
    other = make_certs(tmp / "other", common_name="someone else's CA")
    vectors = np.load(scifact_dir / "corpus.all-MiniLM-L6-v2.npy")[:2000].astype(np.float32)
    index_dir = train_test_index(vectors, tmp / "index", nlist=8, nprobe=8)
    checkpoint = tiny_checkpoint(tmp / "rerank", WORDS)
    read_file, write_file = tmp / "read.tokens", tmp / "write.tokens"
    read_file.write_text(f"# readers\n{READ}\n\n")
    write_file.write_text(f"{WRITE}\n")
    mtls: dict[str, Any] = {
        "tls_cert": str(certs.server_cert),
        "tls_key": str(certs.server_key),
        "tls_client_ca": str(certs.ca),
    }
    health_port = free_port()
    loop = Loop()
    started: list[Any] = []
    try:
        settings = shard_settings(0, 1, 0, redis_server.url, index_dir, tmp)
        shard = loop.run(start_shard(settings.model_copy(update=mtls)))
        started.append(shard)
        reranker = loop.run(
            start_rerank(RerankSettings(port=0, checkpoint=str(checkpoint), threads=1, **mtls))
        )
        started.append(reranker)
        gateway = loop.run(
            start_gateway(
                GatewaySettings(
                    port=0,
                    redis_url=redis_server.url,
                    shards=f"127.0.0.1:{shard.port}",
                    encoder="inprocess",
                    rerank_url=f"127.0.0.1:{reranker.port}",
                    read_tokens_file=str(read_file),
                    write_tokens_file=str(write_file),
                    tokens_reload_s=0.05,
                    tls_cert=str(certs.server_cert),
                    tls_key=str(certs.server_key),
                    tls_ca=str(certs.ca),
                    tls_client_cert=str(certs.client_cert),
                    tls_client_key=str(certs.client_key),
                    health_port=health_port,
                )
            )
        )
        started.append(gateway)
        secured = Secured(loop, gateway, shard, reranker, certs, other, read_file, health_port)
        with secured.channel() as ch:  # every test finds the documents, in any order
            assert _upsert(ch, WRITE).upserted == len(DOCS)
        yield secured
    finally:
        for part in reversed(started):
            if isinstance(part, RunningShard):
                loop.run(part.close(0, snapshot=False))
            else:
                loop.run(part.close(0))
        loop.stop()


def _code(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details() or ""  # type: ignore[attr-defined]


def _search(ch: grpc.Channel, token: str | None, **request: Any) -> search_pb2.SearchResponse:
    return search_pb2_grpc.SearchServiceStub(ch).Search(  # type: ignore[no-any-return]
        search_pb2.SearchRequest(query="read a csv file", k=3, **request),
        timeout=60,
        metadata=bearer_metadata(token),
    )


def _upsert(ch: grpc.Channel, token: str | None) -> documents_pb2.UpsertResponse:
    return documents_pb2_grpc.DocumentServiceStub(ch).Upsert(  # type: ignore[no-any-return]
        documents_pb2.UpsertRequest(documents=DOCS), timeout=60, metadata=bearer_metadata(token)
    )


# --- authentication and authorisation -----------------------------------------------


@pytest.mark.slow
def test_a_write_token_writes_and_reads_through_tls_to_an_mtls_shard_and_reranker(
    secured: Secured,
) -> None:
    """The whole path with every hop encrypted: the documents go in with a write token,
    a reranked search with the same token finds them (the shard answered over mTLS and
    the reranker scored them over mTLS: ``reranked`` is only set by its answer)."""
    with secured.channel() as ch:
        assert _upsert(ch, WRITE).upserted == len(DOCS)
        from retrieval.v1 import common_pb2

        response = _search(
            ch,
            WRITE,
            consistency=common_pb2.CONSISTENCY_STRONG,
            rerank=search_pb2.RerankOptions(enabled=True, depth=6),
        )
        assert len(response.hits) == 3 and response.reranked, response
        assert all(h.id in {d.id for d in DOCS} for h in response.hits)


def test_a_read_token_searches_and_gets(secured: Secured) -> None:
    with secured.channel() as ch:
        _upsert(ch, WRITE)
        assert len(_search(ch, READ).hits) == 3
        got = documents_pb2_grpc.DocumentServiceStub(ch).Get(
            documents_pb2.GetRequest(id="d01"), timeout=30, metadata=bearer_metadata(READ)
        )
        assert got.document.text == DOCS[1].text


def test_a_read_token_cannot_write_permission_denied(secured: Secured) -> None:
    docs = documents_pb2_grpc.DocumentServiceStub
    with secured.channel() as ch:
        code, details = _code(lambda: _upsert(ch, READ))
        assert code is grpc.StatusCode.PERMISSION_DENIED, details
        assert "write token" in details and READ not in details
        code, _ = _code(
            lambda: docs(ch).Delete(
                documents_pb2.DeleteRequest(ids=["d01"]), timeout=30, metadata=bearer_metadata(READ)
            )
        )
        assert code is grpc.StatusCode.PERMISSION_DENIED
        # the refused delete did nothing
        got = docs(ch).Get(
            documents_pb2.GetRequest(id="d01"), timeout=30, metadata=bearer_metadata(READ)
        )
        assert got.document.id == "d01"


@pytest.mark.parametrize(
    "metadata",
    [
        (),
        (("authorization", "Bearer not-a-configured-token"),),
        (("authorization", f"Basic {READ}"),),  # not a bearer token
        (("authorization", "Bearer "),),
        (("authorization", f"Bearer {READ}x"),),  # a configured token plus one character
    ],
    ids=["no-token", "wrong-token", "basic-scheme", "empty-bearer", "token-prefix"],
)
def test_without_a_valid_token_every_method_is_unauthenticated(
    secured: Secured, metadata: tuple[tuple[str, str], ...]
) -> None:
    with secured.channel() as ch:
        search = search_pb2_grpc.SearchServiceStub(ch)
        docs = documents_pb2_grpc.DocumentServiceStub(ch)
        calls: list[Callable[[], object]] = [
            lambda: search.Search(
                search_pb2.SearchRequest(query="x", k=1), timeout=30, metadata=metadata
            ),
            lambda: search.BatchSearch(
                search_pb2.BatchSearchRequest(), timeout=30, metadata=metadata
            ),
            lambda: docs.Get(documents_pb2.GetRequest(id="d01"), timeout=30, metadata=metadata),
            lambda: docs.Upsert(
                documents_pb2.UpsertRequest(documents=DOCS[:1]), timeout=30, metadata=metadata
            ),
            lambda: docs.Delete(
                documents_pb2.DeleteRequest(ids=["d01"]), timeout=30, metadata=metadata
            ),
        ]
        for call in calls:
            code, details = _code(call)
            assert code is grpc.StatusCode.UNAUTHENTICATED, details
            assert READ not in details and "not-a-configured" not in details


def test_health_and_reflection_answer_without_a_token(secured: Secured) -> None:
    with secured.channel() as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        replies = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
        )
        names = [s.name for s in next(iter(replies)).list_services_response.service]
        assert "retrieval.v1.SearchService" in names


def test_refusals_are_counted_in_the_rpc_metrics_without_the_token(secured: Secured) -> None:
    from prometheus_client import generate_latest

    with secured.channel() as ch:
        _code(lambda: _search(ch, "Bearer-less-and-wrong"))
    text = generate_latest(secured.gateway.registry).decode()
    assert 'code="UNAUTHENTICATED"' in text
    assert "Bearer-less-and-wrong" not in text


def test_a_rotated_token_file_is_read_without_a_restart(secured: Secured) -> None:
    """The read token file is replaced as the kubelet does it (a new file renamed over
    the old): the new token works and the old one is refused, with no restart."""
    original = secured.read_file.read_text()
    try:
        fresh = secured.read_file.with_suffix(".new")
        fresh.write_text(f"{ROTATED}\n")
        fresh.replace(secured.read_file)
        with secured.channel() as ch:
            wait_until(lambda: _works(ch, ROTATED), "the rotated token is accepted", timeout=20)
            code, _ = _code(lambda: _search(ch, READ))
            assert code is grpc.StatusCode.UNAUTHENTICATED
            assert len(_search(ch, WRITE).hits) == 3  # the write file is untouched
    finally:
        secured.read_file.write_text(original)
        with secured.channel() as ch:
            wait_until(lambda: _works(ch, READ), "the original token is back", timeout=20)


def _works(ch: grpc.Channel, token: str) -> bool:
    try:
        _search(ch, token)
        return True
    except grpc.RpcError as exc:
        if exc.code() is not grpc.StatusCode.UNAUTHENTICATED:  # type: ignore[attr-defined]
            raise
        return False


# --- TLS and mTLS ---------------------------------------------------------------------


def _health(address: str, tls: ClientTLS | None) -> int:
    with channel(address, tls) as ch:
        return int(
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        )


def test_a_plaintext_client_cannot_talk_to_a_tls_gateway(secured: Secured) -> None:
    code, _ = _code(lambda: _health(secured.address, None))
    assert code is grpc.StatusCode.UNAVAILABLE


def test_a_client_trusting_another_ca_refuses_the_gateway(secured: Secured) -> None:
    code, details = _code(lambda: _health(secured.address, ClientTLS(secured.other.ca)))
    assert code is grpc.StatusCode.UNAVAILABLE, details


def test_an_mtls_shard_refuses_a_client_without_a_certificate(secured: Secured) -> None:
    serving = health_pb2.HealthCheckResponse.SERVING
    certs, other = secured.certs, secured.other
    mine = ClientTLS(certs.ca, certs.client_cert, certs.client_key)
    assert _health(secured.shard_address, mine) == serving  # the control: it does answer
    for who in [
        None,  # plaintext
        ClientTLS(certs.ca),  # TLS, no client certificate
        ClientTLS(certs.ca, other.client_cert, other.client_key),  # wrong CA
    ]:
        code, details = _code(lambda who=who: _health(secured.shard_address, who))  # type: ignore[misc]
        assert code is grpc.StatusCode.UNAVAILABLE, (who, details)


def test_a_router_without_a_client_certificate_gets_no_answer_from_an_mtls_shard(
    secured: Secured,
) -> None:
    """The gateway's own client of the shards: the same router that answers with the
    client certificate (the first test) fails without it, as UNAVAILABLE."""

    async def search(tls: ClientTLS) -> int:
        router = ShardRouter([[secured.shard_address]], tls=tls)
        try:
            query = IndexQuery(np.ones((1, 384), np.float32) / np.sqrt(384), 3)
            result = await router.search(query, timeout=5)
            return len(result.hits[0])
        finally:
            await router.close()

    certs = secured.certs
    with_cert = ClientTLS(certs.ca, certs.client_cert, certs.client_key)
    assert asyncio.run(search(with_cert)) == 3
    with pytest.raises((errors.Unavailable, errors.DeadlineExceeded)):
        asyncio.run(search(ClientTLS(certs.ca)))


def test_probes_get_the_health_status_in_plaintext_on_the_health_port_and_nothing_else(
    secured: Secured,
) -> None:
    """Kubernetes' gRPC probes cannot speak TLS: --health-port answers them in plaintext,
    and serves nothing but the health service."""
    address = f"127.0.0.1:{secured.health_port}"
    assert _health(address, None) == health_pb2.HealthCheckResponse.SERVING
    with channel(address, None) as ch:
        code, _ = _code(lambda: _search(ch, WRITE))
    assert code is grpc.StatusCode.UNIMPLEMENTED


# --- the command line -----------------------------------------------------------------


def _cli(secured: Secured, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    argv = [
        sys.executable,
        "-m",
        "services.cli.main",
        *args,
        "--gateway",
        secured.address,
        "--tls-ca",
        str(secured.certs.ca),
    ]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GTR_")}
    return subprocess.run(
        argv, cwd=ROOT, env={**clean, **env}, capture_output=True, text=True, timeout=120
    )


def test_the_cli_sends_the_token_from_the_flag_or_gtr_token_over_tls(secured: Secured) -> None:
    with secured.channel() as ch:
        _upsert(ch, WRITE)
    got = _cli(secured, "get", "d02", "--token", READ)
    assert got.returncode == 0, got.stderr
    assert DOCS[2].text in got.stdout
    from_env = _cli(secured, "search", "csv", "-k", "2", "--json", GTR_TOKEN=READ)
    assert from_env.returncode == 0, from_env.stderr
    assert '"hits"' in from_env.stdout
    refused = _cli(secured, "delete", "d02", GTR_TOKEN=READ)
    assert refused.returncode == 1 and "PERMISSION_DENIED" in refused.stderr
    assert READ not in refused.stderr
    missing = _cli(secured, "get", "d02")
    assert missing.returncode == 1 and "UNAUTHENTICATED" in missing.stderr


def test_no_auth_on_the_command_line_turns_auth_off_and_nothing_else_does() -> None:
    """The flag as operators type it (pydantic's implicit --no-<field> of ``auth``): a
    field named ``no_auth`` would have made ``--no-auth`` mean False."""
    from services.rpc.settings import SettingsError, load_settings

    base = ["--shards", "127.0.0.1:1", "--encoder", "inprocess"]
    assert load_settings(GatewaySettings, [*base, "--no-auth"]).authenticator() is None
    with pytest.raises(SettingsError) as refused:
        load_settings(GatewaySettings, base)
    assert "--no-auth" in str(refused.value) and "--read-tokens-file" in str(refused.value)


def test_index_stats_reaches_an_mtls_shard_only_with_a_client_certificate(
    secured: Secured,
) -> None:
    certs = secured.certs
    argv = [
        sys.executable,
        "-m",
        "services.cli.main",
        "index",
        "stats",
        secured.shard_address,
        "--tls-ca",
        str(certs.ca),
    ]
    mine = ["--tls-client-cert", str(certs.client_cert), "--tls-client-key", str(certs.client_key)]
    run = {"cwd": ROOT, "capture_output": True, "text": True, "timeout": 120}
    stats = subprocess.run([*argv, *mine], **run)  # type: ignore[call-overload]
    assert stats.returncode == 0, stats.stderr
    assert json.loads(stats.stdout)["replica"] == "r0"  # the shard's Stats, as JSON
    refused = subprocess.run(argv, **run)  # type: ignore[call-overload]
    # the replica that did not answer is named on stderr: exit 1 (2 is a usage error, a
    # traceback would be a crash), stdout empty (no Stats printed for it)
    assert refused.returncode == 1, refused.stderr
    named = f"error: UNAVAILABLE: shard replica {secured.shard_address}: "
    assert named in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr and refused.stdout == ""


def test_index_stats_shows_the_replicas_that_answer_and_names_the_unreachable_one(
    secured: Secured,
) -> None:
    """A replica that does not answer is one line naming its address and UNAVAILABLE on
    stderr, exit status 1, never a gRPC traceback (issue #24 follow-up); listed with
    others, the ones that answer are still shown and the unreachable one is marked."""
    certs = secured.certs
    down = f"127.0.0.1:{free_port()}"  # nothing listens there
    tls = [
        "--tls-ca",
        str(certs.ca),
        "--tls-client-cert",
        str(certs.client_cert),
        "--tls-client-key",
        str(certs.client_key),
    ]
    run = {"cwd": ROOT, "capture_output": True, "text": True, "timeout": 120}

    def index(*argv: str) -> subprocess.CompletedProcess[str]:
        cli = [sys.executable, "-m", "services.cli.main", "index", *argv, *tls]
        return subprocess.run(cli, **run)  # type: ignore[call-overload, no-any-return]

    both = index("stats", secured.shard_address, down)
    assert both.returncode == 1, both.stderr
    up_row, down_row = json.loads(both.stdout)
    assert up_row["address"] == secured.shard_address and up_row["stats"]["replica"] == "r0"
    assert down_row["address"] == down and down_row["error"]["code"] == "UNAVAILABLE"
    assert both.stderr.strip().splitlines() == [
        f"error: UNAVAILABLE: {down_row['error']['message']}"
    ]
    assert f"shard replica {down}" in both.stderr
    for alone in (index("stats", down), index("snapshot", down)):
        assert alone.returncode == 1 and alone.stdout == ""
        lines = alone.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: UNAVAILABLE: shard replica {down}")


# --- the local stack's Redis (`gtr-retrieval up --auth --tls`) -------------------------


@dataclass
class LockedStack:
    stack: Stack
    cfg: StackConfig

    @property
    def url(self) -> str:
        """The whole URL (password, rediss:// and certificates), from the 0600 file."""
        return self.cfg.redis_url_file.read_text(encoding="utf-8").strip()

    @property
    def password(self) -> str:
        return self.cfg.redis_password_file.read_text(encoding="utf-8").strip()


@pytest.fixture(scope="module")
def locked_stack(
    tmp_path_factory: pytest.TempPathFactory, scifact_dir: Path
) -> Iterator[LockedStack]:
    """``up --auth --tls`` as the launcher runs it (its ``start`` and ``ingest``, without
    the signal handling of ``run``): Redis, the first run (encode, train, store), one
    shard and the gateway as child processes (and, as ``run`` does, the shards of a
    rollout's target once the registry records it); the in-process encoder stands in
    for Triton, rerank and Prometheus are off."""
    if redis_binary() is None:
        pytest.fail("redis-server is not installed (scripts/bootstrap.sh installs it)")
    tmp = tmp_path_factory.mktemp("locked-stack")
    corpus = tmp / "corpus.jsonl"
    small_corpus(scifact_dir, corpus, 300, text_chars=120)  # whole abstracts: 60 s to encode
    cfg = StackConfig(
        run_dir=tmp / "run",
        corpus=corpus,
        shards=1,
        encoder="inprocess",
        rerank=False,
        gateway_port=0,
        http_port=0,
        prometheus=False,
        progress=False,
        startup_timeout_s=240,
        auth=True,
        tls=True,
    )
    stack = Stack(cfg)
    try:
        stack.start()
        assert stack.generations is not None
        stack.generations.watch()  # as `run` does: a rollout's target's shards start
        stack.ingest()
        yield LockedStack(stack, cfg)
    finally:
        if stack.generations is not None:
            stack.generations.halt()
        stack.supervisor.stop_all()
        if stack.generations is not None:
            stack.generations.close()


def _redis_refusal(url: str) -> BaseException:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
    try:
        with pytest.raises(redis.RedisError) as refused:
            client.get("stack:ingested:x")
        return refused.value
    finally:
        client.close()


@pytest.mark.slow  # the module's locked stack: a first run and two children, ~2 min
def test_the_local_redis_answers_the_url_file_and_refuses_a_client_without_the_password(
    locked_stack: LockedStack,
) -> None:
    import redis

    url, password = locked_stack.url, locked_stack.password
    assert url.startswith("rediss://") and f":{password}@" in url
    client = redis.Redis.from_url(url)
    try:
        assert client.ping() and client.dbsize() > 0  # the control: the documents are there
    finally:
        client.close()
    without = url.replace(f":{password}@", "")  # TLS with the client certificate, no password
    refused = _redis_refusal(without)
    assert isinstance(refused, redis.AuthenticationError | redis.ResponseError), refused
    assert "auth" in str(refused).lower()
    wrong = url.replace(f":{password}@", ":not-the-password@")
    assert isinstance(_redis_refusal(wrong), redis.AuthenticationError)


@pytest.mark.slow  # the module's locked stack: a first run and two children, ~2 min
def test_the_local_redis_refuses_plaintext_and_a_client_without_a_certificate(
    locked_stack: LockedStack,
) -> None:
    import redis

    url, password = locked_stack.url, locked_stack.password
    address = url.split("@", 1)[1].split("/", 1)[0]
    plaintext = f"redis://:{password}@{address}/0"  # the right password, in the clear
    assert isinstance(_redis_refusal(plaintext), redis.ConnectionError)
    ca = locked_stack.cfg.tls_dir / "ca.pem"
    no_cert = f"rediss://:{password}@{address}/0?ssl_ca_certs={ca}"
    assert isinstance(_redis_refusal(no_cert), redis.ConnectionError)


@pytest.mark.slow  # the module's locked stack: a first run and two children, ~2 min
def test_every_child_reaches_the_locked_redis_and_no_command_line_shows_its_password(
    locked_stack: LockedStack,
) -> None:
    """The first run stored the corpus through the password-protected TLS Redis (its
    marker is there), the shard replayed it and the gateway reads the documents from it:
    a strong search over TLS with the write token finds a stored document with its
    text. No process's command line (what ``ps`` shows every local user) holds the
    password; stack.json does not either; the files that do are mode 0600."""
    stack, cfg = locked_stack.stack, locked_stack.cfg
    password = locked_stack.password
    from services.client.gateway import search_once

    response = search_once(stack.gateway(), "cells", k=3, timeout=60, consistency="strong")
    assert len(response.hits) == 3 and all(h.text for h in response.hits), response
    children = {c.name: c for c in stack.supervisor.children}
    assert {"redis", "gateway", "shard-0-replica-0"} <= set(children)
    for child in children.values():
        assert child.alive(), child.name
        cmdline = Path(f"/proc/{child.pid}/cmdline").read_bytes().decode(errors="replace")
        assert password not in cmdline, child.name
    for name in ("gateway", "shard-0-replica-0"):
        assert "--redis-url-file" in children[name].argv, name
    published = (cfg.run_dir / "stack.json").read_text(encoding="utf-8")
    assert password not in published and "redis_url_file" in published
    for path in (cfg.redis_url_file, cfg.redis_password_file, cfg.redis_config_file):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


@pytest.mark.slow  # the module's locked stack
def test_the_local_stacks_http_port_speaks_tls_and_wants_the_tokens(
    locked_stack: LockedStack,
) -> None:
    """``up --auth --tls``'s HTTP/JSON port (docs/http.md): https with the run's CA, the
    same read and write tokens as the gRPC port."""
    stack, cfg = locked_stack.stack, locked_stack.cfg
    url = urllib.parse.urlsplit(stack.endpoints.gateway_http)
    assert url.scheme == "https" and url.hostname and url.port
    read = (cfg.auth_dir / "read.tokens").read_text(encoding="utf-8").strip()
    client = HttpJson(url.hostname, url.port, ca=cfg.tls_dir / "ca.pem")
    try:
        search = {"query": "cells", "k": 2, "consistency": "CONSISTENCY_STRONG"}
        assert client.post("/v1/search", search).status == 401
        found = client.post("/v1/search", search, token=read)
        assert found.status == 200 and len(found.json["hits"]) == 2, found.body
        doc = {"documents": [{"id": "x", "text": "a read token may not write"}]}
        assert client.post("/v1/documents:upsert", doc, token=read).status == 403
    finally:
        client.close()


def test_speaks_tls_tells_a_tls_server_from_a_plaintext_one(secured: Secured) -> None:
    """What lets `index rollout` say "give --tls-ca" instead of gRPC's "Socket closed"."""
    from services.rpc.tls import speaks_tls

    assert speaks_tls(secured.shard_address) is True  # mTLS: no client certificate offered
    assert speaks_tls(f"dns:///{secured.shard_address}") is True
    assert speaks_tls(f"127.0.0.1:{secured.health_port}") is False  # plaintext gRPC
    assert speaks_tls(f"127.0.0.1:{free_port()}") is None  # nothing listens


@pytest.mark.slow  # the module's locked stack
def test_index_generations_sizes_the_mtls_shards_of_a_tls_stack(
    locked_stack: LockedStack, tmp_path: Path
) -> None:
    """`index generations` asks every generation's replicas for their Stats: under `up
    --tls` they require the run's client certificate, which --run-dir's stack.json names
    (its internal TLS, as `index rollout` takes it). It used to ask in plaintext, so every
    size was unknown (DOCS ?, replicas 0/1) (issue #24 follow-up)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GTR_")}
    argv = [
        sys.executable,
        "-m",
        "services.cli.main",
        "index",
        "generations",
        f"--run-dir={locked_stack.cfg.run_dir}",
    ]
    run = {
        "cwd": tmp_path,
        "env": {**clean, "PYTHONPATH": pythonpath(ROOT)},
        "capture_output": True,
        "text": True,
        "timeout": 120,
    }
    listed = subprocess.run([*argv, "--json"], **run)  # type: ignore[call-overload]
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)["generations"]
    (serving,) = [r for r in rows if r["alias"] == "serving"]
    assert serving["replicas"] >= 1 and serving["replicas_up"] == serving["replicas"]
    assert isinstance(serving["documents"], int) and serving["documents"] > 0
    assert isinstance(serving["bytes"], int) and serving["bytes"] > 0
    table = subprocess.run(argv, **run)  # type: ignore[call-overload]
    assert table.returncode == 0, table.stderr
    line = next(x for x in table.stdout.splitlines() if x.startswith(f"{serving['name']} "))
    assert f"{serving['documents']:,}" in line and " ? " not in line


@pytest.mark.slow  # the module's locked stack, a retrained generation's shard started
def test_a_retrain_rollout_reaches_the_mtls_shards_of_an_auth_tls_stack(
    locked_stack: LockedStack, tmp_path: Path
) -> None:
    """`index rollout --retrain` exports the serving replicas' vectors over gRPC: under
    `up --tls` the shards require the run's client certificate. Without TLS the rollout is
    refused at once, naming --tls-ca, with nothing recorded (before the flags it waited
    --shard-wait-s and failed with "Socket closed"); with --run-dir it takes the stack's
    internal TLS from stack.json, exports, trains, waits until the new generation's
    replica (started by the stack, mTLS too) applied its logs over Stats, and switches;
    a strong search is answered by the new generation. `index rollback` (the same wait)
    returns to g1, the state the module's other tests expect."""
    import redis

    from services.client.gateway import search_once
    from services.generations.registry import Registry

    stack, cfg = locked_stack.stack, locked_stack.cfg
    client = redis.Redis.from_url(locked_stack.url)
    registry = Registry(client)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GTR_")}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "services.cli.main", "index", *args, "--yes", "--quiet"]
        return subprocess.run(
            argv,
            cwd=tmp_path,
            env={**clean, "PYTHONPATH": pythonpath(ROOT)},
            capture_output=True,
            text=True,
            timeout=600,
        )

    try:
        before = [g.name for g in registry.all()]
        assert registry.alias().serving == "g1"
        plaintext = cli(
            "rollout", "--retrain", f"--redis-url-file={cfg.redis_url_file}", "--shard-wait-s=120"
        )
        assert plaintext.returncode == 2, plaintext.stderr
        assert "speaks TLS" in plaintext.stderr and "give --tls-ca" in plaintext.stderr
        assert "Traceback" not in plaintext.stderr
        assert [g.name for g in registry.all()] == before and registry.running() is None

        rolled = cli("rollout", "--retrain", f"--run-dir={cfg.run_dir}", "--shard-wait-s=120")
        assert rolled.returncode == 0, rolled.stdout + rolled.stderr
        serving = registry.alias().serving
        assert serving != "g1" and registry.get(serving).params["mode"] == "retrain"
        response = search_once(stack.gateway(), "cells", k=3, timeout=60, consistency="strong")
        assert response.generation == serving and len(response.hits) == 3

        back = cli("rollback", f"--run-dir={cfg.run_dir}", "--shard-wait-s=120")
        assert back.returncode == 0, back.stdout + back.stderr
        assert registry.alias().serving == "g1"
    finally:
        client.close()


def test_the_floor_benchs_stack_ceiling_reaches_a_tls_gateway_with_a_token(
    secured: Secured,
) -> None:
    """``bench.floor.measure_stack`` (the ceiling of ``loadtest.stack_report``) searches a
    stack started with --tls and --auth when given its CA and token; without the token
    every search is refused."""
    from bench.floor import measure_stack

    with secured.channel() as ch:
        _upsert(ch, WRITE)
    creds = grpc.ssl_channel_credentials(Path(secured.certs.ca).read_bytes())
    args = (secured.address, ["a query"], "dense", 3, 0.5, 1, creds)
    with_token = measure_stack(*args, bearer_metadata(READ))
    assert with_token["searches"] > 0 and with_token["failed"] == 0
    without = measure_stack(*args)
    assert without["searches"] == 0 and without["failed"] > 0
