"""Chaos, bounded: the local stack under writes, searches and faults (issue #11).

``gtr-retrieval up`` runs as a user runs it (2 shards × 2 replicas, the in-process
encoder, no rerank) on a small SciFact corpus. While upserts and deletes go in at a
steady rate and searches run, the test kills a replica (kill -9), kills Redis
(kill -9), stops a replica (SIGSTOP) during a burst of 300 concurrent searches with
k=10 and k=1000, and lets it go on. Then it checks what users are promised:

* no acknowledged write is lost, no acknowledged delete comes back (exact filtered
  searches with every inverted list probed, read-your-writes on the merged token), in
  the vectors and in the text index alike: a sparse search for each document's own
  term finds exactly the acknowledged ones, and neither a sparse nor a hybrid search
  returns a deleted one;
* no search failed except by its own deadline or, during the burst, by ``up``'s admission
  limit (RESOURCE_EXHAUSTED with its ``retry-after-ms`` hint), and no OK answer came from
  zero shards;
* no process of the stack is gone for good: the supervisor restarted what died and
  every child serves again.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from retrieval.v1 import common_pb2, documents_pb2, documents_pb2_grpc, search_pb2, search_pb2_grpc
from services.common import positions
from tests.support.local_stack import small_corpus
from tests.support.processes import free_port, pythonpath
from tests.support.shards import ROOT

# Serial too (what the searches get under kills and a burst is what it asserts): scripts/test.sh
# runs it alone, after the other slow tests.
pytestmark = [pytest.mark.slow, pytest.mark.serial]

# texts cut to 120 characters: what is checked is durability and availability, not
# relevance, and whole abstracts (256 tokens each) took 2 of the setup's 2.5 minutes to
# encode on CI's two cores
CORPUS_DOCS = 600
WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "kappa",
    "sigma",
    "omega",
    "lumen",
    "vortex",
    "quark",
    "prism",
    "ember",
]


# A call that failed with one of these may have taken effect (the server ran it and its
# answer was lost, or it ran out of time after the write): its outcome is unknown.
UNKNOWN_OUTCOME = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
}


@dataclass
class Up:
    process: subprocess.Popen[bytes]
    run_dir: Path
    gateway: str
    log: Path

    def stack(self) -> dict[str, Any]:
        return json.loads((self.run_dir / "stack.json").read_text())  # type: ignore[no-any-return]

    def child(self, name: str) -> dict[str, Any]:
        return next(c for c in self.stack()["children"] if c["name"] == name)


def _until(condition: Callable[[], bool], timeout: float, what: str, up: Up) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if up.process.poll() is not None:
            raise AssertionError(f"gtr-retrieval up exited:\n{up.log.read_text()[-4000:]}")
        try:
            if condition():
                return
        except (OSError, ValueError, StopIteration, KeyError):
            pass  # stack.json between writes, a child not listed yet
        time.sleep(0.1)
    raise AssertionError(f"{what} not within {timeout:.0f} s:\n{up.log.read_text()[-4000:]}")


def _serving(address: str) -> bool:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=1.0
            )
            return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
    except grpc.RpcError:
        return False


@pytest.fixture
def up(tmp_path: Path, scifact_dir: Path) -> Iterator[Up]:
    corpus = tmp_path / "corpus.jsonl"
    small_corpus(scifact_dir, corpus, CORPUS_DOCS, text_chars=120)
    port = free_port()
    run_dir = tmp_path / "run"
    log = tmp_path / "up.log"
    env = {**os.environ, "PYTHONPATH": pythonpath(ROOT), "OMP_NUM_THREADS": "1"}
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.cli.main",
                "up",
                "--corpus",
                str(corpus),
                "--run-dir",
                str(run_dir),
                "--shards",
                "2",
                "--replicas",
                "2",
                "--encoder",
                "inprocess",
                "--no-rerank",
                "--no-prometheus",
                "--port",
                str(port),
                "--http-port",
                "0",
            ],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    handle = Up(proc, run_dir, f"127.0.0.1:{port}", log)
    try:
        _until(lambda: (run_dir / "stack.json").exists(), 600, "the stack up", handle)
        yield handle
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


@dataclass
class Record:
    upserted: dict[str, dict[int, str]] = field(default_factory=dict)  # acked: id → token
    deleted: dict[str, dict[int, str]] = field(default_factory=dict)
    # deletes that failed without saying whether they happened (UNAVAILABLE when Redis
    # was killed after it ran the delete and before the gateway read the reply, a
    # deadline): either state is allowed, so these promise neither kept nor gone
    delete_unknown: set[str] = field(default_factory=set)
    outcomes: Counter[str] = field(default_factory=Counter)
    zero_shard_oks: int = 0
    searches: int = 0
    # up's admission limit (16 per CPU by default, issue #33) refuses part of the burst:
    # refusals are promised only while the burst is in flight, each with its retry hint
    bursting: bool = False
    refused_outside_burst: int = 0
    refused_without_hint: int = 0
    burst_oks: int = 0

    def token(self) -> dict[int, str]:
        return positions.merge_tokens(*self.upserted.values(), *self.deleted.values())


def _token(pb: common_pb2.WriteToken) -> dict[int, str]:
    return {p.shard: p.position for p in pb.positions}


async def _writes(stub: Any, record: Record, stop: asyncio.Event) -> None:
    rng = random.Random(1)
    i = 0
    while not stop.is_set():
        i += 1
        doc_id = f"chaos-{i}"
        text = " ".join(rng.choice(WORDS) for _ in range(12)) + f" marker{i}"
        try:
            reply = await stub.Upsert(
                documents_pb2.UpsertRequest(
                    documents=[
                        documents_pb2.Document(id=doc_id, text=text, metadata={"chaos": doc_id})
                    ]
                ),
                timeout=5,
            )
            record.upserted[doc_id] = _token(reply.write_token)
            if i % 4 == 0:
                try:
                    gone = await stub.Delete(documents_pb2.DeleteRequest(ids=[doc_id]), timeout=5)
                except grpc.aio.AioRpcError as exc:
                    if exc.code() in UNKNOWN_OUTCOME:
                        record.delete_unknown.add(doc_id)
                    raise
                if gone.deleted == 1:
                    record.deleted[doc_id] = _token(gone.write_token)
        except grpc.aio.AioRpcError:
            pass  # not acknowledged: nothing is promised about it
        await asyncio.sleep(0.05)  # a steady rate of ~15 writes/s


async def _search(stub: Any, record: Record, query: str, k: int, timeout: float) -> None:
    record.searches += 1
    try:
        reply = await stub.Search(search_pb2.SearchRequest(query=query, k=k), timeout=timeout)
    except grpc.aio.AioRpcError as exc:
        record.outcomes[exc.code().name] += 1
        if exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
            record.refused_outside_burst += not record.bursting
            hints = [v for k, v in exc.trailing_metadata() or () if k == "retry-after-ms"]
            record.refused_without_hint += not hints
        return
    record.outcomes["OK"] += 1
    record.burst_oks += record.bursting
    if len(reply.missing_shards) == 2:
        record.zero_shard_oks += 1


async def _searches(stub: Any, record: Record, stop: asyncio.Event) -> None:
    rng = random.Random(2)
    while not stop.is_set():
        await _search(stub, record, " ".join(rng.choice(WORDS) for _ in range(3)), 10, 3.0)


def test_the_stack_keeps_its_promises_under_kills_stops_and_a_burst(up: Up) -> None:
    gateway = up.gateway
    record = Record()

    def restarted(name: str, old_pid: int) -> Callable[[], bool]:
        def check() -> bool:
            child = up.child(name)
            return bool(
                child["pid"] != old_pid and child["state"] == "running" and child["restarts"]
            )

        return check

    async def in_thread(fn: Callable[[], None]) -> None:
        await asyncio.get_running_loop().run_in_executor(None, fn)

    async def chaos() -> None:
        async with grpc.aio.insecure_channel(gateway) as channel:
            docs = documents_pb2_grpc.DocumentServiceStub(channel)
            search = search_pb2_grpc.SearchServiceStub(channel)
            stop = asyncio.Event()
            background: list[Awaitable[None]] = [
                asyncio.ensure_future(_writes(docs, record, stop)),
                *[asyncio.ensure_future(_searches(search, record, stop)) for _ in range(2)],
            ]

            async def acked_more(n: int) -> None:
                goal = len(record.upserted) + n
                while len(record.upserted) < goal:
                    await asyncio.sleep(0.05)

            await acked_more(10)
            replica = up.child("shard-0-replica-1")
            os.kill(replica["pid"], signal.SIGKILL)
            await in_thread(
                lambda: _until(restarted(replica["name"], replica["pid"]), 90, "replica", up)
            )
            await acked_more(10)

            redis_child = up.child("redis")
            os.kill(redis_child["pid"], signal.SIGKILL)
            await in_thread(lambda: _until(restarted("redis", redis_child["pid"]), 60, "redis", up))
            await acked_more(10)

            stopped = up.child("shard-1-replica-0")
            os.kill(stopped["pid"], signal.SIGSTOP)
            record.bursting = True
            try:
                rng = random.Random(3)
                await asyncio.gather(
                    *[
                        _search(
                            search,
                            record,
                            " ".join(rng.choice(WORDS) for _ in range(3)),
                            10 if i % 2 else 1000,
                            8.0,
                        )
                        for i in range(300)
                    ]
                )
            finally:
                record.bursting = False
                os.kill(stopped["pid"], signal.SIGCONT)
            await acked_more(10)
            stop.set()
            await asyncio.gather(*background)

    asyncio.run(chaos())

    # no search failed except by its own deadline or, during the burst, by the admission
    # limit's refusal with its retry hint; no OK answer from zero shards
    failed = {code: n for code, n in record.outcomes.items() if code not in ("OK",)}
    assert set(failed) <= {"DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"}, (failed, record.outcomes)
    assert record.refused_outside_burst == 0, record.outcomes
    assert record.refused_without_hint == 0, record.outcomes
    assert record.zero_shard_oks == 0
    assert record.burst_oks > 0, record.outcomes  # the burst was served up to the limit
    # the stack kept answering throughout (the burst is mostly refused now: 245 OK of 558
    # in CI with up's default limit, where it was all answered without one)
    assert record.outcomes["OK"] > 150, record.outcomes

    # no process gone for good
    _until(
        lambda: all(c["state"] == "running" for c in up.stack()["children"]),
        60,
        "every child running",
        up,
    )
    for child in up.stack()["children"]:
        os.kill(child["pid"], 0)  # alive
        if child["name"].startswith(("shard-", "gateway")):
            assert _serving(child["address"]), child

    # nothing acknowledged lost, nothing deleted back
    manifest = json.loads((up.run_dir / "index" / "manifest.json").read_text())
    nlist = int(manifest["nlist"])
    token = record.token()
    kept = [
        i for i in record.upserted if i not in record.deleted and i not in record.delete_unknown
    ]
    assert kept and record.deleted

    async def verify() -> tuple[list[str], list[str]]:
        lost, back = [], []
        async with grpc.aio.insecure_channel(gateway) as channel:
            search = search_pb2_grpc.SearchServiceStub(channel)
            docs = documents_pb2_grpc.DocumentServiceStub(channel)
            write_token = common_pb2.WriteToken(
                positions=[common_pb2.ShardPosition(shard=s, position=p) for s, p in token.items()]
            )

            async def present(doc_id: str) -> bool:
                reply = await search.Search(
                    search_pb2.SearchRequest(
                        query="marker",
                        k=1,
                        ids_only=True,
                        nprobe=nlist,
                        filter=common_pb2.Filter(
                            must=[common_pb2.FieldCondition(key="chaos", any_of=[doc_id])]
                        ),
                        consistency=common_pb2.CONSISTENCY_SESSION,
                        write_token=write_token,
                        require_complete=True,
                    ),
                    timeout=30,
                )
                in_index = [h.id for h in reply.hits] == [doc_id]
                # the text index: the document's own term (marker<i>), sparse and hybrid
                own = f"marker{doc_id.removeprefix('chaos-')}"
                in_text = {}
                for mode in (search_pb2.RETRIEVAL_MODE_SPARSE, search_pb2.RETRIEVAL_MODE_HYBRID):
                    found = await search.Search(
                        search_pb2.SearchRequest(
                            query=own,
                            k=1,
                            ids_only=True,
                            nprobe=nlist,
                            mode=mode,
                            consistency=common_pb2.CONSISTENCY_SESSION,
                            write_token=write_token,
                            require_complete=True,
                        ),
                        timeout=30,
                    )
                    assert not found.partial, found
                    in_text[mode] = [h.id for h in found.hits][:1] == [doc_id]
                try:
                    await docs.Get(documents_pb2.GetRequest(id=doc_id), timeout=10)
                    stored = True
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() is grpc.StatusCode.NOT_FOUND
                    stored = False
                assert in_index == stored, (doc_id, in_index, stored)
                assert in_text[search_pb2.RETRIEVAL_MODE_SPARSE] == stored, (doc_id, stored)
                if not stored:  # a hybrid top hit may come from the dense list otherwise
                    assert not in_text[search_pb2.RETRIEVAL_MODE_HYBRID], doc_id
                return stored

            for doc_id in kept:
                if not await present(doc_id):
                    lost.append(doc_id)
            for doc_id in record.deleted:
                if await present(doc_id):
                    back.append(doc_id)
        return lost, back

    lost, back = asyncio.run(verify())
    assert lost == [] and back == [], (lost, back)
