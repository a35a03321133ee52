"""The gateway across a switch of the serving index generation (issue #24,
docs/generations.md "Searches and writes across a switch"), on real parts: a real
redis-server, generation g1's two shard processes, generation g2's three shard processes
(``--generation g2``: another shard count and another encoder, the perturbed MiniLM of
tests/support/encoders.py, in-process), and two real gateways on free ports driven over
gRPC. The test plays the rollout's part with the registry (``Registry.switch``, the writer
gates) and the builder's idempotent appends (``TargetAppender``), as
services/generations does; the gateway is what is under test.

* Gateway B re-reads the alias every 100 ms: the searches it answers while the alias flips
  each name one generation, and are answered wholly by it (its encoder's model, its
  shards' documents: a marker document each generation alone holds).
* Gateway A re-reads it only every minute, so it still holds the old alias after a switch:
  its first write finds g1's writer gate closed and is written again to g2; a write token
  of a newer epoch (taken on B after a rollback) makes it re-read the alias before it
  searches.
* A token taken before a switch is honoured after it: the write's document is found by a
  SESSION search on the new generation (the token's raw positions would not even be valid
  there, which the test checks first).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis

from retrieval.v1 import (
    common_pb2,
    documents_pb2,
    documents_pb2_grpc,
    search_pb2,
    search_pb2_grpc,
)
from services.common.domain import Document
from services.common.errors import FailedPrecondition, Unavailable
from services.common.positions import compare
from services.gateway.server import Gateway, start_gateway
from services.gateway.settings import GatewaySettings
from services.generations.append import TargetAppender, UpsertItem
from services.generations.registry import EncoderSpec, Registry
from services.index.core.ids import shard_of
from services.index.keys import ADDRESSES_KEY, CLOSED, GenerationKeys, Layout
from tests.encoder_fixtures import encoder_base, torch_embedder
from tests.support import loop_dump
from tests.support.encoders import ensure_second_encoder
from tests.support.processes import run_redis, wait_until
from tests.support.shards import ShardCluster, run_shards, scifact_vectors, shared_test_index

BASE = 2
G1 = GenerationKeys("g1", Layout(BASE, BASE))
G2 = GenerationKeys("g2", Layout(3, BASE))
MINILM = "all-MiniLM-L6-v2"
PERTURBED = "all-MiniLM-L6-v2-perturbed"

DOCS = [
    ("csv", "csv.reader", "Read rows of a csv file one list at a time."),
    ("json", "json.loads", "Parse a json document into Python objects."),
    ("hash", "hashlib", "Compute a sha256 hash of bytes."),
    ("pool", "ThreadPoolExecutor", "Run callables in a pool of threads."),
]
MARKER_TEXT = "Zebra lanterns glow at dusk over the quiet harbour."
MARKER_QUERY = "zebra lanterns glowing at dusk in the harbour"


def moving_id(prefix: str) -> str:
    """An id whose shard in g2 (3 shards) is not its shard in g1 (2 shards)."""
    n = 0
    while shard_of(f"{prefix}-{n}", 2) == shard_of(f"{prefix}-{n}", 3):
        n += 1
    return f"{prefix}-{n}"


class GatewayThread:
    """A real gateway (start_gateway) serving on a loop in a thread of its own."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.gateway: Gateway = self._run(start_gateway(settings), 300)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.gateway.port}")
        self.search_stub = search_pb2_grpc.SearchServiceStub(self.channel)
        self.docs = documents_pb2_grpc.DocumentServiceStub(self.channel)

    def _run(self, step: Any, timeout: float) -> Any:
        return asyncio.run_coroutine_threadsafe(step, self.loop).result(timeout)

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        return self.gateway.registry.get_sample_value(name, labels or {})

    def by_model(self, sample: str) -> dict[str, float]:
        """``sample`` summed by its ``model`` label (over its other labels)."""
        out: dict[str, float] = {}
        for family in self.gateway.registry.collect():
            for s in family.samples:
                if s.name == sample:
                    out[s.labels["model"]] = out.get(s.labels["model"], 0.0) + s.value
        return out

    def upsert(self, doc_id: str, text: str, title: str = "") -> common_pb2.WriteToken:
        doc = documents_pb2.Document(id=doc_id, title=title, text=text)
        reply = self.docs.Upsert(documents_pb2.UpsertRequest(documents=[doc]), timeout=60)
        return reply.write_token

    def search(
        self, query: str, token: common_pb2.WriteToken | None = None, **fields: Any
    ) -> search_pb2.SearchResponse:
        request = search_pb2.SearchRequest(query=query, k=5, **fields)
        if token is not None:
            request.consistency = common_pb2.CONSISTENCY_SESSION
            request.write_token.CopyFrom(token)
        return self.search_stub.Search(request, timeout=30)

    def close(self) -> None:
        self.channel.close()
        try:
            self._run(self.gateway.close(0), 60)
        except TimeoutError:
            raise AssertionError(
                f"the gateway did not close in 60 s; its loop runs:\n{loop_dump.pending(self.loop)}"
            ) from None
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


@dataclass
class World:
    url: str
    client: Any
    registry: Registry
    nlist: int
    g1_shards: ShardCluster
    a: GatewayThread  # re-reads the alias every minute: stale across a switch
    b: GatewayThread  # every 100 ms
    minilm: Any
    perturbed: Any
    load_token: common_pb2.WriteToken
    extra: dict[str, Any] = field(default_factory=dict)


def gateway_settings(url: str, shards: ShardCluster, refresh_ms: float) -> GatewaySettings:
    return GatewaySettings(
        port=0,
        redis_url=url,
        shards=";".join(",".join(r) for r in shards.addresses),
        encoder="inprocess",
        auth=False,
        alias_refresh_ms=refresh_ms,
    )


def copy_into(world: World, ids: list[str], source: Layout, target: GenerationKeys) -> None:
    """The builder's part: the stored documents ``ids`` of ``source``, embedded by the
    target generation's encoder, appended to its logs (with the document copies: every
    target here has another layout than its source)."""
    embedder = world.perturbed if target.name == "g2" else world.minilm
    items = []
    for doc_id in ids:
        title, text, meta, ver = world.client.hmget(
            source.doc(doc_id), "title", "text", "meta", "ver"
        )
        assert ver is not None, f"{doc_id} is not stored in {source}"
        doc = Document(doc_id, text.decode(), title.decode())
        vectors, _ = embedder.embed([doc.embedding_text], "document")
        items.append(UpsertItem(doc_id, int(ver), vectors[0], doc.title, doc.text, meta.decode()))
    appended = TargetAppender(world.client, target, copy_documents=True).upserts(items)
    assert sorted(appended.ids) == sorted(ids)


def tails(world: World, keys: GenerationKeys) -> dict[int, str]:
    out = {}
    for s in range(keys.num_shards):
        last = world.client.xrevrange(keys.log(s), count=1)
        if last:
            out[s] = last[0][0].decode()
    return out


def logged_ids(world: World, keys: GenerationKeys, shard: int) -> set[str]:
    """Every id an entry of ``keys``'s log of ``shard`` names."""
    return {
        i for _, entry in world.client.xrange(keys.log(shard)) for i in json.loads(entry[b"ids"])
    }


def token_dict(token: common_pb2.WriteToken) -> dict[int, str]:
    return {p.shard: p.position for p in token.positions}


class Watcher:
    """Searches on a gateway in a thread until stopped: every answer's generation, model
    and ids (errors too), to check that each answer came wholly from one generation."""

    def __init__(self, gw: GatewayThread, nlist: int) -> None:
        self.gw, self.nlist = gw, nlist
        self.answers: list[tuple[str, str, list[str]]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                r = self.gw.search(MARKER_QUERY, nprobe=self.nlist)
                self.answers.append((r.generation, r.model, [h.id for h in r.hits]))
            except grpc.RpcError as exc:
                self.errors.append(f"{exc.code()}: {exc.details()}")

    def __enter__(self) -> Watcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)

    def seen(self, generation: str) -> bool:
        return any(g == generation for g, _, _ in self.answers)


def check_each_answer_is_one_generation(answers: list[tuple[str, str, list[str]]]) -> None:
    models = {"g1": MINILM, "g2": PERTURBED}
    for generation, model, ids in answers:
        assert generation in models, f"an answer names {generation!r}"
        assert model == models[generation], f"{generation} answered with {model}'s query"
        own, other = ("only-g1", "only-g2") if generation == "g1" else ("only-g2", "only-g1")
        assert own in ids and other not in ids, f"{generation}'s answer held {ids}"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, scifact_dir: Path) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("gateway-generations")
    index_dir = shared_test_index(tmp_path_factory.getbasetemp(), scifact_vectors(scifact_dir))
    nlist = json.loads((index_dir / "manifest.json").read_text())["nlist"]
    second = ensure_second_encoder(encoder_base(tmp_path_factory))
    with (
        run_redis(tmp / "redis") as store,
        run_shards(index_dir, store.url, tmp / "g1", shards=BASE) as g1_shards,
    ):
        client = redis.Redis.from_url(store.url)
        a = GatewayThread(gateway_settings(store.url, g1_shards, 60_000))
        b = GatewayThread(gateway_settings(store.url, g1_shards, 100))
        try:
            for doc_id, title, text in DOCS:
                a.upsert(doc_id, text, title)
            load_token = a.upsert("only-g1", MARKER_TEXT, "marker")
            from services.encoder.model import default_model_dir

            w = World(
                store.url,
                client,
                Registry(client),
                nlist,
                g1_shards,
                a,
                b,
                torch_embedder(default_model_dir()),
                torch_embedder(second),
                load_token,
            )
            # Generation g2 as a rollout builds it: 3 shards, the perturbed encoder, the
            # documents re-embedded and copied into its layout, plus one of its own.
            g2 = w.registry.create(
                3,
                EncoderSpec(PERTURBED, 0, 384, "", str(second)),
                str(index_dir),
                {"trained": True},
            )
            assert g2.name == "g2"
            copy_into(w, [d[0] for d in DOCS], G1.layout, G2)
            vector, _ = w.perturbed.embed([f"marker {MARKER_TEXT}"], "document")
            TargetAppender(client, G2, copy_documents=True).upserts(
                [UpsertItem("only-g2", 1, vector[0], "marker", MARKER_TEXT)]
            )
            w.registry.set_gates(G2.layout, "g2")  # closed until now; g1's stay g1's
            with run_shards(
                index_dir, store.url, tmp / "g2", shards=3, settings={"generation": "g2"}
            ) as g2_shards:
                w.registry.set_addresses("g2", ";".join(",".join(r) for r in g2_shards.addresses))
                yield w
        finally:
            a.close()
            b.close()
            client.close()


def test_a_switch_moves_searches_writes_and_tokens_to_the_next_generation(world: World) -> None:
    a, b = world.a, world.b
    before = a.search(MARKER_QUERY, world.load_token, nprobe=world.nlist)
    assert (before.generation, before.model) == ("g1", MINILM)
    assert before.hits[0].id == "only-g1"

    # A write acknowledged before the switch, on a shard whose g2 counterpart is another.
    x = moving_id("before-switch")
    t1 = a.upsert(x, "The kettle whistles when the water boils.")
    assert (t1.generation, t1.epoch) == ("g1", 1)

    with Watcher(b, world.nlist) as watcher:
        wait_until(lambda: len(watcher.answers) >= 3, "B answers before the switch", 60)
        # The rollout's switch: close g1's gates, replay what came meanwhile, switch.
        world.registry.set_gates(G1.layout, CLOSED)
        copy_into(world, [x], G1.layout, G2)
        switch_in = tails(world, G2)
        raw = token_dict(t1)
        (s1,) = raw
        assert compare(switch_in.get(s1, "0-0"), raw[s1]) < 0, (
            "g2's log of the token's shard ends before the token's position: sent to g2's "
            "shards as it is, the token would be refused (INVALID_ARGUMENT), so only a "
            "gateway that resolves it finds the write"
        )
        alias = world.registry.switch("g2", switch_in)
        assert alias.epoch == 2
        wait_until(lambda: watcher.seen("g2"), "B answers with g2 after the switch", 30)
        wait_until(
            lambda: sum(g == "g2" for g, _, _ in watcher.answers) >= 3, "more g2 answers", 30
        )
    assert not watcher.errors, watcher.errors[:3]
    assert watcher.seen("g1") and watcher.seen("g2")
    check_each_answer_is_one_generation(watcher.answers)
    # once B named g2, it never answered with g1 again
    first_g2 = next(i for i, (g, _, _) in enumerate(watcher.answers) if g == "g2")
    assert all(g == "g2" for g, _, _ in watcher.answers[first_g2:])

    # B's SLO and latency series name the encoder of the generation that answered: the
    # searches it answered with g2 under g2's encoder, and its objectives under that one
    # alone (they used to keep the model the gateway started with).
    answered = {g: sum(x == g for x, _, _ in watcher.answers) for g in ("g1", "g2")}
    searched = b.by_model("gtr_search_seconds_count")
    assert searched.get(PERTURBED, 0.0) >= answered["g2"] >= 3, (searched, answered)
    assert b.by_model("gtr_encode_calls_total").get(PERTURBED, 0.0) >= answered["g2"]
    assert b.by_model("gateway_stage_seconds_count").get(PERTURBED, 0.0) > 0
    assert set(b.by_model("gtr_slo_seconds")) == {PERTURBED}

    # The token from before the switch, on the new generation.
    after = b.search("kettle whistles boiling water", t1, nprobe=world.nlist)
    assert after.generation == "g2" and x in [h.id for h in after.hits]
    assert {h.shard for h in after.hits} <= {0, 1, 2}

    # A still holds the old alias: its write finds g1's gate closed and goes to g2.
    assert a.metric("gateway_serving_generation", {"generation": "g1"}) == 1.0
    y = moving_id("after-switch")
    t2 = a.upsert(y, "Lighthouses warn ships away from the rocks.")
    assert (t2.generation, t2.epoch) == ("g2", 2)
    assert a.metric("gateway_generation_moved_writes_total") == 1.0
    assert a.metric("gateway_serving_generation", {"generation": "g2"}) == 1.0
    (shard,) = token_dict(t2)
    assert shard == G2.layout.shard(y)
    assert y in logged_ids(world, G2, shard)
    assert not any(y in logged_ids(world, G1, s) for s in range(BASE))
    assert world.client.exists(G2.layout.doc(y)) and not world.client.exists(G1.layout.doc(y))
    found = a.search("lighthouses and ships near rocks", t2, nprobe=world.nlist)
    assert (found.generation, found.model) == ("g2", PERTURBED)
    assert found.hits[0].id == y
    world.extra["after_switch"] = y


def test_a_rollback_serves_every_write_since_the_switch_and_a_newer_token_is_awaited(
    world: World,
) -> None:
    a, b = world.a, world.b
    if world.registry.alias().serving != "g2":
        pytest.fail("needs g2 serving: run the module (the switch test comes first)")
    z = moving_id("on-g2")
    tz = b.upsert(z, "Owls hunt mice in the barn at night.")
    assert (tz.generation, tz.epoch) == ("g2", 2)
    since_switch = [z, *([world.extra["after_switch"]] if "after_switch" in world.extra else [])]

    with Watcher(b, world.nlist) as watcher:
        wait_until(lambda: watcher.seen("g2"), "B answers with g2", 30)
        # The rollback: g2's gates close, its writes since its switch go to g1, switch back.
        world.registry.set_gates(G2.layout, CLOSED)
        copy_into(world, since_switch, G2.layout, G1)
        alias = world.registry.switch("g1", tails(world, G1))
        world.registry.set_gates(G1.layout, "g1")
        assert (alias.serving, alias.epoch, alias.previous) == ("g1", 3, "g2")
        wait_until(
            lambda: sum(g == "g1" for g, _, _ in watcher.answers) >= 3, "B answers with g1", 30
        )
    assert not watcher.errors, watcher.errors[:3]
    check_each_answer_is_one_generation(watcher.answers)

    # A token of g2 (an older epoch, another generation) on g1: its write is there.
    back = b.search("owls hunting mice at night", tz, nprobe=world.nlist)
    assert (back.generation, back.model) == ("g1", MINILM)
    assert back.hits[0].id == z

    # A still holds epoch 2 (g2); a token of epoch 3 makes it read the alias first.
    assert a.metric("gateway_generation_alias_epoch") == 2.0
    w = moving_id("after-rollback")
    tw = b.upsert(w, "Glaciers carve valleys over thousands of years.")
    assert (tw.generation, tw.epoch) == ("g1", 3)
    newer = a.search("glaciers carving valleys", tw, nprobe=world.nlist)
    assert (newer.generation, newer.model) == ("g1", MINILM)
    assert newer.hits[0].id == w
    assert a.metric("gateway_generation_alias_epoch") == 3.0

    # A token of an epoch the store has not reached is refused, naming the field.
    future = common_pb2.WriteToken()
    future.CopyFrom(tw)
    future.epoch = 9
    with pytest.raises(grpc.RpcError) as refused:
        a.search("glaciers", future)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "write_token: epoch 9" in (refused.value.details() or "")


def test_a_write_whose_gate_stays_closed_is_unavailable_at_its_deadline_and_writes_nothing(
    world: World,
) -> None:
    """A switch that never reopens the gates (a drain stuck): the gateway retries within
    the write's deadline, then answers UNAVAILABLE (safe to retry) before the client's
    own deadline ends, and nothing is stored."""
    serving = world.registry.alias().serving
    layout = G1.layout if serving == "g1" else G2.layout
    moved_before = world.b.metric("gateway_generation_moved_writes_total") or 0.0
    world.registry.set_gates(layout, CLOSED)
    try:
        doc = documents_pb2.Document(id="never-written", text="Nothing of this is stored.")
        with pytest.raises(grpc.RpcError) as refused:
            world.b.docs.Upsert(documents_pb2.UpsertRequest(documents=[doc]), timeout=2.0)
    finally:
        world.registry.set_gates(layout, serving)
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE, refused.value.details()
    assert "switching" in (refused.value.details() or "")
    assert (world.b.metric("gateway_generation_moved_writes_total") or 0.0) - moved_before > 1
    assert not world.client.exists(layout.doc("never-written"))
    assert not world.client.exists(layout.version("never-written"))


def test_writes_paused_at_closed_gates_leave_the_searches_their_room(world: World) -> None:
    """Issue #33: in a bench switch the writes paused at the closed writer gates (21/s over
    ~1.2 s) held 24 of the gateway's 32 admission units and its searches were refused
    RESOURCE_EXHAUSTED. A paused write lends its units back (services/common/parking.py):
    with as many writes paused as the limit, another client's searches are all answered,
    and the writes are all acknowledged once the gates open. (Without the lending each
    search is refused: the writes hold the whole limit.)"""
    serving = world.registry.alias().serving
    layout = G1.layout if serving == "g1" else G2.layout
    settings = gateway_settings(world.url, world.g1_shards, 100).model_copy(
        update={"max_in_flight": 8, "client_share": 1.0}  # the limit alone, no share
    )
    gateway = GatewayThread(settings)
    searcher = grpc.insecure_channel(f"127.0.0.1:{gateway.gateway.port}")  # another client
    moved = "gateway_generation_moved_writes_total"
    world.registry.set_gates(layout, CLOSED)
    writes: list[Any] = []
    try:
        for n in range(8):
            doc = documents_pb2.Document(id=f"paused-{n}", text=f"Paused write number {n}.")
            seen = gateway.metric(moved) or 0.0
            writes.append(
                gateway.docs.Upsert.future(documents_pb2.UpsertRequest(documents=[doc]), timeout=60)
            )

            # its first attempt and one more retry of any write: staggered, so that their
            # retries (each holds its unit again for a moment) do not all fall together
            def retried(seen: float = seen) -> bool:
                return (gateway.metric(moved) or 0.0) - seen >= 2

            wait_until(retried, f"write {n} paused at the closed gate", 30)
        stub = search_pb2_grpc.SearchServiceStub(searcher)
        answered = [
            stub.Search(search_pb2.SearchRequest(query="glaciers", k=5), timeout=30)
            for _ in range(10)
        ]
        assert all(w.running() for w in writes), "a write ended while the gates were closed"
    finally:
        world.registry.set_gates(layout, serving)
        try:
            for write in writes:
                write.result(60)
        finally:
            searcher.close()
            gateway.close()
    assert len(answered) == 10 and all(a.generation == serving for a in answered)
    assert all(world.client.exists(layout.doc(f"paused-{n}")) for n in range(8))


def test_a_gateway_without_shards_takes_the_base_count_and_g1_from_the_store(
    world: World,
) -> None:
    """Once g1 is retired its shards are gone: a gateway started then needs no addresses
    of it (the stack used to list unreachable placeholders of the base count). Without
    --shards the base count comes from the store's key layout and g1's addresses, while g1
    serves, from {gtr}:addrs (none there: UNAVAILABLE naming --shards)."""
    no_shards = gateway_settings(world.url, world.g1_shards, 100).model_copy(update={"shards": ""})
    if world.registry.alias().serving != "g1":
        pytest.fail("needs g1 serving: run the module (the rollback test comes before)")
    assert world.registry.addresses("g1") is None
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(Unavailable, match=r"g1 has no shard addresses .*--shards"):
            loop.run_until_complete(start_gateway(no_shards))
    finally:
        loop.close()

    # g2 serves again and g1 is retired, its shards' addresses with it.
    world.registry.set_gates(G1.layout, CLOSED)
    alias = world.registry.switch("g2", tails(world, G2))
    world.registry.set_gates(G2.layout, "g2")
    world.registry.set_state("g1", "retired")
    world.client.hdel(ADDRESSES_KEY, "g1")
    assert alias.serving == "g2" and world.registry.base_shards() == BASE
    c = GatewayThread(no_shards)
    try:
        reply = c.search(MARKER_QUERY, nprobe=world.nlist)
        assert (reply.generation, reply.model) == ("g2", PERTURBED)
        assert reply.hits[0].id == "only-g2" and not reply.partial
        assert c.metric("gateway_serving_generation", {"generation": "g2"}) == 1.0
    finally:
        c.close()


def test_without_shards_a_store_with_no_layout_is_refused_naming_shards(tmp_path: Path) -> None:
    """The base shard count is the store's: with neither --shards nor a key layout there is
    none to take (FAILED_PRECONDITION); once a layout is recorded, it is the layout's."""
    from services.gateway.server import base_shard_count
    from services.index.layout import check_layout_at

    with run_redis(tmp_path / "redis") as store:
        settings = GatewaySettings(redis_url=store.url, auth=False)
        with pytest.raises(FailedPrecondition, match="--shards is empty and the store has no"):
            base_shard_count(settings)
        check_layout_at(store.url, 3)
        assert base_shard_count(settings) == 3
        assert base_shard_count(settings.model_copy(update={"shards": "a:1;b:1"})) == 2
