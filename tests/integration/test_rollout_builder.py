"""The rollout builder (services/generations/builder.py) on a real Redis, with the store
written by the real writer (ChangeLogWriter), the documents re-embedded by the real
encoder in this process (all-MiniLM-L6-v2) and, for the rollout to 3 shards, real shard
processes of the new generation:

- a rollout 2 → 3 shards with writes after P0 and right before the switch ends with the
  target's logs holding exactly the store's documents (ids, versions, texts, vectors of
  the new encoder), its replicas holding them, the alias switched and the gates moved;
- a builder killed with SIGKILL mid-bulk and run again ends with the same logs as an
  uninterrupted run, with no (id, version) appended twice;
- rollback replays the writes since the switch into the previous generation; retire
  deletes the retired generation's logs and its layout's documents.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Coroutine, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from services.common.errors import GenerationMoved
from services.encoder.base import Encoder
from services.encoder.runtime.inprocess import InProcessEncoder
from services.generations.builder import (
    RolloutBuilder,
    RolloutOptions,
    RolloutPlan,
    embedding_text,
)
from services.generations.lifecycle import retire
from services.generations.progress import Progress
from services.generations.registry import EncoderSpec, Registry
from services.generations.replicas import ReplicaStats, all_stats
from services.generations.serving_latency import LatencySummary
from services.generations.state import RolloutStore
from services.index.client.writer import DocRecord
from services.index.keys import (
    CLOSED,
    CPU_PLACED_KEY,
    LAYOUT_KEY,
    SEARCH_LATENCY_KEY,
    GenerationKeys,
    Layout,
)
from services.process.redis_client import sync_client
from tests.support.generation_logs import changes, folded
from tests.support.hash_store import write_async
from tests.support.processes import RedisServer, wait_until
from tests.support.redis_cluster import RedisCluster
from tests.support.shards import ShardProcess, start_shard, train_test_index

pytestmark = pytest.mark.slow  # each test encodes hundreds of documents; some start shards

REDIS_DB = 10  # module_redis: the rolled-out store is shared by the module's tests
CRASH_DB, TWIN_DB = 14, 15  # the kill -9 test's store and its uninterrupted twin
RETRAIN_DB = 12  # the --retrain test's store
ROOT = Path(__file__).resolve().parents[2]
DIM = 384
SPEC = EncoderSpec("embed", 1, DIM, "minilm", "all-MiniLM-L6-v2")
WORDS = [
    "protein",
    "cell",
    "gene",
    "tumour",
    "virus",
    "vaccine",
    "brain",
    "heart",
    "insulin",
    "enzyme",
    "receptor",
    "bacteria",
    "membrane",
    "signal",
    "immune",
    "response",
    "dose",
    "trial",
    "mouse",
    "patient",
]


def _docs(start: int, n: int, tag: str = "") -> list[DocRecord]:
    rng = np.random.default_rng(start)
    out = []
    for i in range(start, start + n):
        words = " ".join(rng.choice(WORDS, 12))
        vec = rng.standard_normal(DIM).astype(np.float32)
        out.append(
            DocRecord(
                f"d{i}",
                vec / np.linalg.norm(vec),
                title=f"title {i}{tag}",
                text=f"{words} {tag}",
                metadata={"n": str(i % 3)},
            )
        )
    return out


def _write(
    url: str, keys: GenerationKeys, upserts: list[DocRecord], deletes: Sequence[str] = ()
) -> Coroutine[Any, Any, None]:
    return write_async(url, keys, upserts, deletes, dim=DIM, batch=32)


def _write_now(
    url: str, keys: GenerationKeys, upserts: list[DocRecord], deletes: Sequence[str] = ()
) -> None:
    """Write from another thread's event loop (the builder's loop is busy in a callback)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(_write(url, keys, upserts, deletes))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


def _new_store(url: str, docs: int) -> Any:
    client = sync_client(url)
    client.flushdb()
    client.hset(LAYOUT_KEY, mapping={"version": "2", "shards": "2"})
    Registry(client).ensure_first(2, SPEC, "")
    asyncio.run(_write(url, G1, _docs(0, docs)))
    return client


G1 = GenerationKeys("g1", Layout(2, 2))


def _store_state(client: Any, layout: Layout) -> dict[str, tuple[int, str]]:
    """id → (version, body) of every document stored in ``layout``."""
    out = {}
    for key in client.scan_iter(match="doc:*", count=1000):
        k = key.decode()
        doc_id = k.split("}:", 1)[1]
        if layout.doc(doc_id) != k:
            continue
        d = client.hgetall(key)
        title, text = d[b"title"].decode(), d[b"text"].decode()
        out[doc_id] = (int(d[b"ver"]), f"{title} {text}" if title else text)
    return out


@pytest.fixture(scope="module")
def encoder() -> Iterator[Encoder]:
    enc = InProcessEncoder.torch(threads=1)
    yield enc
    asyncio.run(enc.close())


def _encoders(encoder: Encoder, calls: list[int] | None = None) -> Any:
    async def make(spec: EncoderSpec) -> Encoder:
        return _Shared(encoder, calls)

    return make


class _Shared(Encoder):
    """The module's encoder, not closed by the builder; ``calls`` counts its encodes."""

    def __init__(self, inner: Encoder, calls: list[int] | None = None) -> None:
        self.inner, self.model_name, self.dim = inner, inner.model_name, inner.dim
        self.max_batch = inner.max_batch
        self.calls = calls if calls is not None else []

    async def encode(self, texts: Any, kind: Any, timeout: float | None = None) -> Any:
        self.calls.append(len(texts))
        return await self.inner.encode(texts, kind, timeout)

    async def close(self) -> None:
        return None


@dataclass
class RolledOut:
    url: str
    client: Any
    shards: list[ShardProcess]
    work: Path
    gates_at_hand_over: set[str]  # g1's writer gates when the stack's record let g2 go


class _WritesDuringTheRollout(Progress):
    """Writes after P0 (at the bulk's start) and right before the switch closes the
    gates; starts the target's shard processes once it is trained."""

    def __init__(
        self, url: str, client: Any, work: Path, shards: list[ShardProcess], encoder: Encoder
    ) -> None:
        super().__init__()
        self.url, self.client, self.work, self.shards = url, client, work, shards
        # the writes carry the encoder's vectors, as the gateway's do (encoded here:
        # phase() runs inside the builder's event loop)
        self.at_bulk = _encoded(encoder, _docs(300, 20) + _docs(0, 10, " updated"))
        self.at_switch = _encoded(encoder, _docs(400, 5))
        self.hand_over: threading.Thread | None = None
        self.gates_at_hand_over: set[str] = set()

    def phase(self, name: str) -> None:
        super().phase(name)
        if name == "bulk":
            _write_now(
                self.url,
                G1,
                self.at_bulk,
                deletes=[f"d{i}" for i in range(10, 20)],
            )
            target = Registry(self.client).get("g2")
            for shard in range(3):
                self.shards.append(
                    start_shard(
                        index_dir=Path(target.index_dir),
                        redis_url=self.url,
                        shard=shard,
                        shards=3,
                        work_dir=self.work,
                        replica=f"g2-{shard}",
                        settings={"generation": "g2"},
                        wait=False,
                    )
                )
            Registry(self.client).set_addresses("g2", ";".join(p.address for p in self.shards))
        if name == "switch":
            _write_now(self.url, G1, self.at_switch, deletes=["d20", "d21", "d22"])
            # A local stack with a CPU budget still holds g2's processes on it: the
            # builder must wait for its hand-over before it closes the writes.
            self.client.set(CPU_PLACED_KEY, "g2", ex=120)
            self.hand_over = threading.Thread(target=self._hand_over, daemon=True)
            self.hand_over.start()

    def _hand_over(self) -> None:
        # the stack's next pass, half a second on (its poller's interval): what the gates
        # said then, before the record stops naming g2
        time.sleep(0.5)
        self.gates_at_hand_over = {Registry(self.client).gate(G1.layout, s) for s in range(2)}
        self.client.set(CPU_PLACED_KEY, "", ex=120)


@pytest.fixture(scope="module")
def rolled_out(
    module_redis: str, encoder: Encoder, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RolledOut]:
    work = tmp_path_factory.mktemp("rollout")
    client = _new_store(module_redis, 300)
    shards: list[ShardProcess] = []
    progress = _WritesDuringTheRollout(module_redis, client, work, shards, encoder)
    options = RolloutOptions(
        index_root=work / "generations", batch=32, sample=300, shard_wait_s=120.0, hand_over_s=60.0
    )
    builder = RolloutBuilder(client, _encoders(encoder), options, progress)
    try:
        asyncio.run(builder.rollout(RolloutPlan(num_shards=3)))
        assert progress.hand_over is not None
        progress.hand_over.join()
        yield RolledOut(module_redis, client, shards, work, progress.gates_at_hand_over)
    finally:
        for proc in shards:
            proc.stop()
        client.close()


def test_a_rollout_to_3_shards_holds_exactly_the_acknowledged_documents(
    rolled_out: RolledOut, encoder: Encoder
) -> None:
    client = rolled_out.client
    g2 = GenerationKeys("g2", Layout(3, 2))
    expected = _store_state(client, G1.layout)
    assert len(expected) == 300 + 20 + 5 - 10 - 3  # written, minus the deletes
    state = folded(client, g2)
    assert {i: (v, body) for i, (v, body, _) in state.items()} == expected
    # The documents were copied into the 3-shard layout with their versions.
    assert _store_state(client, g2.layout) == expected
    # Each vector is the encoder's of the document's text (the bulk's re-embedded, the
    # replayed writes' as the writer logged them: a reshard keeps the encoder).
    some = sorted(expected)[:8]
    docs = [client.hgetall(G1.layout.doc(i)) for i in some]
    texts = [embedding_text(d[b"title"].decode(), d[b"text"].decode()) for d in docs]
    want = asyncio.run(encoder.encode(texts, "document")).vectors
    got = np.array([state[i][2] for i in some], dtype=np.float32)
    assert (np.sum(want * got, axis=1) > 0.999).all()
    logged = changes(client, g2)
    assert len(logged) == len(set(logged))  # no (id, version) twice


def test_the_switch_moved_the_alias_and_the_gates_and_the_replicas_hold_it(
    rolled_out: RolledOut,
) -> None:
    client = rolled_out.client
    # the switch waited for the stack's CPU hand-over: writes still went to g1 then
    assert rolled_out.gates_at_hand_over == {"g1"}
    registry = Registry(client)
    alias = registry.alias()
    assert (alias.serving, alias.previous, alias.epoch) == ("g2", "g1", 2)
    g2 = registry.get("g2")
    assert g2.state == "serving" and g2.params["trained"] and g2.num_shards == 3
    assert registry.get("g1").state == "previous"
    assert {registry.gate(Layout(2, 2), s) for s in range(2)} == {CLOSED}
    assert {registry.gate(Layout(3, 2), s) for s in range(3)} == {"g2"}
    assert client.exists("{gtr}:rollout") == 0
    stats = asyncio.run(all_stats(registry.addresses("g2") or ""))
    first = [replicas[0] for replicas in stats]
    assert all(isinstance(r, ReplicaStats) for r in first), first
    held = sum(r.vectors for r in first if isinstance(r, ReplicaStats))
    assert held == len(_store_state(client, G1.layout))
    # The source's logs are no longer held back by the rollout; g2's are, for a rollback.
    assert not any(
        k.startswith(b"rollout:") for s in range(2) for k in client.hkeys(G1.snapshots(s))
    )
    assert all(
        client.hget(GenerationKeys("g2", Layout(3, 2)).snapshots(s), "rollback:g1")
        for s in range(3)
    )


def test_a_write_to_the_old_generation_is_refused_after_the_switch(rolled_out: RolledOut) -> None:
    with pytest.raises(GenerationMoved) as caught:
        asyncio.run(_write(rolled_out.url, G1, _docs(900, 1)))
    assert caught.value.gate == CLOSED


def test_rollback_replays_the_writes_since_the_switch_then_retire_deletes_the_layout(
    rolled_out: RolledOut, encoder: Encoder
) -> None:
    client = rolled_out.client
    g2 = GenerationKeys("g2", Layout(3, 2))
    asyncio.run(
        _write(rolled_out.url, g2, _docs(500, 6) + _docs(30, 2, " again"), deletes=["d40", "d41"])
    )
    options = RolloutOptions(
        index_root=rolled_out.work / "generations", batch=32, wait_for_shards=False
    )
    asyncio.run(RolloutBuilder(client, _encoders(encoder), options).rollback())
    registry = Registry(client)
    alias = registry.alias()
    assert (alias.serving, alias.previous, alias.epoch) == ("g1", "g2", 3)
    # g1's logs fold to the 3-shard layout's documents: every write since the switch is in.
    expected = _store_state(client, g2.layout)
    assert "d500" in expected and "d40" not in expected
    assert {i: (v, b) for i, (v, b, _) in folded(client, G1).items()} == expected
    assert _store_state(client, G1.layout) == expected  # copied back into the base layout
    assert {registry.gate(Layout(2, 2), s) for s in range(2)} == {"g1"}
    # g1's logs are held for a rollback to g2; g2's hold for one to g1 is released.
    assert all(client.hget(G1.snapshots(s), "rollback:g2") for s in range(2))
    assert not any(client.hget(g2.snapshots(s), "rollback:g1") for s in range(3))
    for proc in rolled_out.shards:  # as the stack does once g2 is retired
        proc.stop()
    done = retire(client, "g2")
    assert done.generation.state == "retired" and done.documents_deleted == len(expected)
    assert not any(client.exists(g2.log(s)) for s in range(3))
    assert _store_state(client, g2.layout) == {}
    assert registry.alias().previous is None


def _run_builder(url: str, root: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.support.rollout_runner",
            "--redis-url",
            url,
            "--index-root",
            str(root),
            "--batch",
            "16",
            "--sample",
            "256",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def test_a_builder_killed_mid_bulk_resumes_to_the_logs_of_an_uninterrupted_run(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    crashed_url = f"redis://127.0.0.1:{redis_server.port}/{CRASH_DB}"
    twin_url = f"redis://127.0.0.1:{redis_server.port}/{TWIN_DB}"
    crashed, twin = _new_store(crashed_url, 500), _new_store(twin_url, 500)
    try:
        straight = _run_builder(twin_url, tmp_path / "twin")
        first = _run_builder(crashed_url, tmp_path / "crashed")

        def mid_bulk() -> bool:
            state = RolloutStore(crashed).load()
            return state is not None and state.phase == "bulk" and state.done >= 320

        wait_until(mid_bulk, "the builder half-way through the bulk pass", timeout=300)
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        killed = RolloutStore(crashed).load()
        assert killed is not None and killed.phase == "bulk"  # it was killed mid-way
        again = _run_builder(crashed_url, tmp_path / "crashed")
        for proc in (again, straight):
            out, err = proc.communicate(timeout=600)
            assert proc.returncode == 0, err.decode()[-2000:]
            assert b"serving g2" in out
        g2 = GenerationKeys("g2", Layout(2, 2))
        a, b = folded(crashed, g2), folded(twin, g2)
        assert set(a) == set(b) and len(a) == 500
        assert all(a[i][:2] == b[i][:2] for i in a)  # versions and texts
        va = np.array([a[i][2] for i in sorted(a)])
        vb = np.array([b[i][2] for i in sorted(b)])
        assert np.abs(va - vb).max() < 2e-3  # the same encoder's vectors (batching aside)
        logged = changes(crashed, g2)
        assert len(logged) == len(set(logged)) == 500  # nothing appended twice
        assert json.loads(crashed.hget("{gtr}:gens", "g2"))["state"] == "serving"
    finally:
        for c in (crashed, twin):
            c.flushdb()
            c.close()


class _WritesAfterP0(Progress):
    """Writes after P0, before the export (their real versions come in by the replay);
    keeps the builder's messages."""

    def __init__(self, url: str, encoder: Encoder) -> None:
        super().__init__()
        self.url = url
        self.docs = _encoded(encoder, _docs(700, 8) + _docs(5, 4, " edited"))
        self.messages: list[str] = []

    def message(self, text: str) -> None:
        self.messages.append(text)

    def phase(self, name: str) -> None:
        super().phase(name)
        if name == "train":
            _write_now(self.url, G1, self.docs, deletes=["d50", "d51"])


def _encoded(encoder: Encoder, docs: list[DocRecord]) -> list[DocRecord]:
    """The documents with the encoder's vectors of their text (as the gateway writes them)."""

    texts = [embedding_text(d.title, d.text) for d in docs]

    async def run() -> Any:
        step = encoder.max_batch
        parts = [
            await encoder.encode(texts[i : i + step], "document")
            for i in range(0, len(texts), step)
        ]
        return np.concatenate([p.vectors for p in parts])

    vectors = asyncio.run(run())
    return [replace(d, vector=v) for d, v in zip(docs, vectors, strict=True)]


class _SlowSearches:
    """A gateway that reports, every 0.2 s while in use, a p99 ten times its baseline."""

    def __init__(self, url: str) -> None:
        self.client = sync_client(url)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._report, daemon=True)

    def _report(self) -> None:
        slow = LatencySummary(200, 10.0, 100.0, baseline_searches=500, baseline_p99_ms=10.0)
        while True:
            stamped = replace(slow, at=time.time())
            self.client.hset(SEARCH_LATENCY_KEY, "gateway-test", stamped.to_json())
            if self.stop.wait(0.2):
                return

    def __enter__(self) -> _SlowSearches:
        self.thread.start()
        wait_until(lambda: self.client.hlen(SEARCH_LATENCY_KEY) == 1, "the first report", 10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        self.client.close()


def test_retrain_appends_the_vectors_the_source_replicas_hold_then_replays_from_p0(
    redis_server: RedisServer, encoder: Encoder, tmp_path: Path
) -> None:
    url = f"redis://127.0.0.1:{redis_server.port}/{RETRAIN_DB}"
    client = sync_client(url)
    client.flushdb()
    client.hset(LAYOUT_KEY, mapping={"version": "2", "shards": "2"})
    docs = _encoded(encoder, _docs(0, 300))
    index_dir = train_test_index(np.stack([d.vector for d in docs]), tmp_path / "g1-index")
    Registry(client).ensure_first(2, SPEC, str(index_dir))
    asyncio.run(_write(url, G1, docs))
    shards = [
        start_shard(
            index_dir=index_dir,
            redis_url=url,
            shard=s,
            shards=2,
            work_dir=tmp_path,
            replica=f"g1-{s}",
            wait=False,
        )
        for s in range(2)
    ]
    try:
        for proc in shards:
            proc.wait_serving(120)
        Registry(client).set_addresses("g1", ";".join(p.address for p in shards))
        options = RolloutOptions(
            index_root=tmp_path / "generations", batch=32, sample=300, wait_for_shards=False
        )
        calls: list[int] = []
        writes = _WritesAfterP0(url, encoder)
        builder = RolloutBuilder(client, _encoders(encoder, calls), options, writes)
        with _SlowSearches(url):
            asyncio.run(builder.rollout(RolloutPlan(retrain=True)))
        # no encoder call at all: the export's vectors, then the log entries' own
        assert calls == []
    finally:
        for proc in shards:
            proc.stop()
    # the exported chunks went through the pacer, which slowed them for the slow searches
    summary = [m for m in writes.messages if m.startswith("pacing summary ")]
    assert summary, writes.messages
    paced = json.loads(summary[-1].removeprefix("pacing summary "))
    assert paced["busy_s"] > 0 and paced["paused_s"] > 0 and paced["cuts"] >= 1, paced
    try:
        g2 = GenerationKeys("g2", Layout(2, 2))
        expected = _store_state(client, G1.layout)
        assert len(expected) == 300 + 8 - 2
        state = folded(client, g2)
        assert set(state) == set(expected)
        after_p0 = {f"d{i}" for i in [*range(700, 708), *range(5, 9)]}
        for doc_id, (version, body, _) in state.items():
            assert body == expected[doc_id][1]
            # reused vectors: version 0; written after P0: replayed with their version
            assert version == (expected[doc_id][0] if doc_id in after_p0 else 0), doc_id
        for d in writes.docs:  # replayed: the very vectors the writer logged
            assert state[d.doc_id][2] == tuple(round(float(x), 4) for x in d.vector)
        # Every vector is the encoder's of the document's text, within SQ8's round trip.
        ids = sorted(expected)
        stored = [client.hgetall(G1.layout.doc(i)) for i in ids]
        want = _encoded(
            encoder,
            [
                DocRecord(i, np.zeros(DIM), d[b"title"].decode(), d[b"text"].decode())
                for i, d in zip(ids, stored, strict=True)
            ],
        )
        got = np.array([state[i][2] for i in ids], dtype=np.float32)
        cosine = np.sum(got * np.stack([w.vector for w in want]), axis=1)
        assert cosine.min() > 0.999
        g2_record = Registry(client).get("g2")
        assert g2_record.params["mode"] == "retrain" and g2_record.encoder == SPEC
        assert Registry(client).alias().serving == "g2"
    finally:
        client.flushdb()
        client.close()


def test_a_reshard_on_a_redis_cluster_copies_and_appends_every_document(
    redis_cluster: RedisCluster, encoder: Encoder, tmp_path: Path
) -> None:
    """The builder's SCAN runs per primary, each append script in one target shard's slot."""
    wait_until(redis_cluster.healthy, "cluster_state:ok", timeout=60)
    redis_cluster.flush()
    url = redis_cluster.url
    client = sync_client(url)
    try:
        client.hset(LAYOUT_KEY, mapping={"version": "2", "shards": "2"})
        Registry(client).ensure_first(2, SPEC, "")
        asyncio.run(_write(url, G1, _docs(0, 260)))

        class AfterP0(Progress):
            def phase(self, name: str) -> None:
                super().phase(name)
                if name == "bulk":
                    _write_now(url, G1, _docs(3, 2, " edited"), deletes=["d9"])

        options = RolloutOptions(
            index_root=tmp_path / "generations", batch=32, sample=300, wait_for_shards=False
        )
        builder = RolloutBuilder(client, _encoders(encoder), options, AfterP0())
        asyncio.run(builder.rollout(RolloutPlan(num_shards=3)))
        g2 = GenerationKeys("g2", Layout(3, 2))
        expected = {}
        for doc_id in (f"d{i}" for i in range(260)):
            d = client.hgetall(G1.layout.doc(doc_id))
            if d:
                expected[doc_id] = (int(d[b"ver"]), f"{d[b'title'].decode()} {d[b'text'].decode()}")
        assert len(expected) == 259 and expected["d3"][1].endswith("edited")
        assert {i: (v, b) for i, (v, b, _) in folded(client, g2).items()} == expected
        copies = {i: client.hget(g2.layout.doc(i), "ver") for i in expected}
        assert all(int(v) == expected[i][0] for i, v in copies.items())
        assert Registry(client).alias().serving == "g2"
    finally:
        redis_cluster.flush()
        client.close()
