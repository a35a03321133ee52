"""Each phase of a rollout (services/generations/phase_*.py, rollback.py, lifecycle.py) run
alone on a real Redis: a :class:`RolloutContext` over a store written by the real writer
(ChangeLogWriter), the state recorded by the real RolloutStore, and a tiny deterministic
encoder in this process standing in for Triton (the encoder is not the subject here: the
vector of a text is a hash of it, so a test knows which vector each document must get).

Every test checks what its phase alone must leave behind: the record it moves on, the
target's logs, the registry (alias, gates, states) and the holds on the logs. The store
and the encoder stand-in are tests/support/hash_store.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest

from services.common.domain import Document
from services.common.encoder_spec import EncoderSpec
from services.common.errors import FailedPrecondition, Unavailable
from services.encoder.base import Embeddings, Encoder
from services.gateway.document_pipeline import DocumentPipeline
from services.gateway.generation_parts import Bundle, RedisAliasReader
from services.gateway.generations import GenerationSource
from services.generations import logs, stack_placed
from services.generations.builder import RolloutBuilder
from services.generations.context import RolloutContext, RolloutOptions, Wiring
from services.generations.encoding import embedding_text
from services.generations.errors import HeldEntriesExceeded
from services.generations.held import lag_and_added
from services.generations.lifecycle import retire
from services.generations.phase_bulk import run_bulk
from services.generations.phase_catch_up import HOLD_LIFTED_S, report, run_catch_up
from services.generations.phase_publish import record_target, run_create, run_p0, run_publish
from services.generations.phase_switch import run_switch
from services.generations.phase_train import run_train
from services.generations.progress import Progress
from services.generations.registry import Generation, Registry
from services.generations.state import RecordedPlan, RolloutState, RolloutStore
from services.index.client.connection import StoreConnection
from services.index.client.writer import ChangeLogWriter
from services.index.keys import CLOSED, CPU_BUDGET_KEY, CPU_PLACED_KEY, HOLD_LIFTED_KEY
from services.process.redis_client import sync_client
from tests.support.generation_logs import changes, folded
from tests.support.hash_store import (
    DIM,
    G1,
    G2,
    SPEC,
    HashEncoder,
    doc,
    expected,
    g1_store,
    hash_encoders,
    vector,
    write,
    write_async,
)

NEW = EncoderSpec("embed", 2, DIM, "hash-v2", "hash")
OWNER = "phase-test"


@pytest.fixture
def store(redis_url: str, tmp_path: Path) -> Iterator[Any]:
    client = g1_store(redis_url, tmp_path)
    yield client
    client.close()


def _context(
    client: Any,
    tmp_path: Path,
    phase: str,
    *,
    record: bool = True,
    encoder: EncoderSpec = NEW,
    encoders: Any = hash_encoders,
    **options: Any,
) -> RolloutContext:
    """A rollout g1 -> g2 recorded in ``phase`` and claimed by this test (g2's record
    written unless ``record`` is False), g2's encoder ``encoder`` (by default another
    one than g1's: its vectors are re-embedded; g1's own, SPEC: a retrain)."""
    store = RolloutStore(client)
    retrain = encoder == SPEC
    plan = RecordedPlan(encoder, 2, retrain, "")
    mode: Literal["retrain", "encode"] = "retrain" if retrain else "encode"
    started = store.start(
        RolloutState(target="g2", source="g1", mode=mode, phase=phase, plan=plan, owner=OWNER)
    )
    assert started is not None
    if record:
        record_target(Registry(client), tmp_path, "g2", "g1", 2, encoder, mode, 0.0)
    wiring = Wiring(encoders, options.pop("publisher", None), applied=options.pop("applied", None))
    return RolloutContext(
        client,
        Registry(client),
        store,
        RolloutOptions(**{"index_root": tmp_path, "batch": 8, "wait_for_shards": False, **options}),
        wiring,
        Progress(),
        store.claim(started, OWNER),
    )


def _run(ctx: RolloutContext, phase: Any) -> RolloutState:
    async def go() -> None:
        try:
            await phase(ctx)
        finally:
            await ctx.close()

    asyncio.run(go())
    return ctx.state


def _stored(client: Any) -> RolloutState:
    state = RolloutStore(client).load()
    assert state is not None
    return state


# --- publish, create, p0 --------------------------------------------------------------


def test_publish_records_the_published_version_in_the_plan_and_the_target(
    store: Any, tmp_path: Path
) -> None:
    published: list[tuple[str, bool]] = []

    def publisher(folder: str, int8_unmeasured: bool) -> EncoderSpec:
        published.append((folder, int8_unmeasured))
        return NEW

    ctx = _context(store, tmp_path, "publish", record=False, publisher=publisher)
    ctx.state = ctx.save(plan=RecordedPlan(None, 2, False, "/checkpoints/new"))
    _run(ctx, run_publish)
    assert published == [("/checkpoints/new", False)]
    recorded = _stored(store)
    assert recorded.phase == "create" and recorded.plan is not None
    assert recorded.plan.encoder == NEW and recorded.plan.encoder_dir == "/checkpoints/new"
    assert not recorded.plan.int8_unmeasured
    target = Registry(store).get("g2")
    assert (target.state, target.encoder) == ("building", NEW)
    assert target.index_dir == str(tmp_path.resolve() / "g2")


def test_a_publish_passes_the_recorded_int8_unmeasured_and_keeps_it_in_the_plan(
    store: Any, tmp_path: Path
) -> None:
    """A rollout started with --int8-unmeasured and killed while publishing publishes
    the same way when resumed: the flag is the recorded plan's, not the resume's."""
    published: list[bool] = []

    def publisher(folder: str, int8_unmeasured: bool) -> EncoderSpec:
        published.append(int8_unmeasured)
        return NEW

    ctx = _context(store, tmp_path, "publish", record=False, publisher=publisher)
    plan = RecordedPlan(None, 2, False, "/checkpoints/new", int8_unmeasured=True)
    ctx.state = ctx.save(plan=plan)
    assert _stored(store).plan == plan  # recorded as asked
    _run(ctx, run_publish)
    assert published == [True]
    recorded = _stored(store).plan
    assert recorded is not None and recorded.int8_unmeasured and recorded.encoder == NEW


def test_a_publish_that_fails_leaves_no_rollout_behind(store: Any, tmp_path: Path) -> None:
    def publisher(folder: str, int8_unmeasured: bool) -> EncoderSpec:
        raise FailedPrecondition("embed cannot serve it")

    ctx = _context(store, tmp_path, "publish", record=False, publisher=publisher)
    ctx.save(plan=RecordedPlan(None, 2, False, "/checkpoints/new"))
    with pytest.raises(FailedPrecondition, match="cannot serve"):
        _run(ctx, run_publish)
    assert RolloutStore(store).load() is None  # the lock was all there was
    assert [g.name for g in Registry(store).all()] == ["g1"]


def test_create_refuses_a_rollout_whose_target_was_never_recorded(
    store: Any, tmp_path: Path
) -> None:
    ctx = _context(store, tmp_path, "create", record=False)
    with pytest.raises(FailedPrecondition, match="stopped before recording it"):
        _run(ctx, run_create)
    assert _stored(store).phase == "create"


def test_p0_records_the_source_tails_and_holds_its_logs_there(store: Any, tmp_path: Path) -> None:
    ctx = _context(store, tmp_path, "p0")
    tails = logs.tails(store, G1)
    state = _run(ctx, run_p0)
    recorded = _stored(store)
    assert recorded == state
    assert recorded.phase == "train"
    assert recorded.p0 == tails and recorded.positions == tails
    assert recorded.replayed == {0: 0, 1: 0}
    for shard, position in tails.items():
        assert store.hget(G1.snapshots(shard), "rollout:g2") == position.encode()


# --- train, bulk ----------------------------------------------------------------------


def test_train_trains_the_target_on_an_encoded_sample_and_marks_it_trained(
    store: Any, tmp_path: Path
) -> None:
    ctx = _context(store, tmp_path, "train", sample=40)
    state = _run(ctx, run_train)
    target = Registry(store).get("g2")
    assert target.params["trained"] is True and target.params["nlist"] >= 1
    assert (tmp_path / "g2" / "manifest.json").exists()
    assert state.phase == "bulk" and _stored(store) == state
    # the sample's documents are appended already; the bulk pass goes on after them
    assert not state.cursor.finished and 40 <= state.done < 60 and state.total == 60
    assert len(folded(store, G2)) == state.done


def test_bulk_appends_every_document_with_the_targets_vector(store: Any, tmp_path: Path) -> None:
    ctx = _context(store, tmp_path, "bulk", parallel=3)
    state = _run(ctx, run_bulk)
    assert state.phase == "catch_up" and state.cursor.finished and state.done == 60
    assert _stored(store) == state
    assert Registry(store).get("g2").state == "catching_up"
    appended = folded(store, G2)
    docs = {d.doc_id: d for d in (doc(i) for i in range(60))}
    assert set(appended) == set(docs)
    assert all(appended[i][2] == expected(docs[i]) for i in docs)
    assert len(changes(store, G2)) == 60  # once each


def test_bulk_resumed_from_a_saved_cursor_appends_nothing_twice(store: Any, tmp_path: Path) -> None:
    ctx = _context(store, tmp_path, "train", sample=24)
    _run(ctx, run_train)
    first = changes(store, G2)
    resumed = RolloutContext(
        store,
        Registry(store),
        RolloutStore(store),
        RolloutOptions(index_root=tmp_path, batch=8, wait_for_shards=False),
        Wiring(hash_encoders),
        Progress(),
        _stored(store),
    )
    _run(resumed, run_bulk)
    after = changes(store, G2)
    assert set(first) <= set(after)  # what the first run appended stays
    assert sorted({c[0] for c in after}) == sorted(f"d{i}" for i in range(60))
    assert len(after) == 60


def test_bulk_leaves_the_documents_written_after_p0_to_the_catch_up(
    store: Any, tmp_path: Path, redis_url: str
) -> None:
    ctx = _context(store, tmp_path, "p0")
    _run(ctx, run_p0)
    late = [doc(3, "late"), doc(70, "late")]  # one stored before P0, one new
    write(redis_url, G1, late)
    ctx.save(phase="bulk")
    state = _run(ctx, run_bulk)
    assert state.phase == "catch_up" and state.cursor.finished and state.done == 61
    # the bulk encoded what was stored at P0 only: d3's old text would be overtaken anyway
    assert {c[0] for c in changes(store, G2)} == {f"d{i}" for i in range(60)} - {"d3"}
    state = _run(ctx, run_catch_up)
    assert state.phase == "switch"
    replayed = folded(store, G2)
    assert set(replayed) == {f"d{i}" for i in range(60)} | {"d70"}
    assert all(replayed[d.doc_id][2] == expected(d) for d in late)
    assert all(replayed[d.doc_id][2] == expected(d) for d in map(doc, range(4, 60)))


# --- catch_up, switch -----------------------------------------------------------------


def test_catch_up_replays_the_writes_after_p0_into_the_target(
    store: Any, tmp_path: Path, redis_url: str
) -> None:
    ctx = _context(store, tmp_path, "p0")
    _run(ctx, run_p0)
    before = sum(store.xlen(G1.log(s)) for s in range(2))
    late = [doc(i, "late") for i in (3, 70, 71)]
    write(redis_url, G1, late, deletes=["d5"])
    written = sum(store.xlen(G1.log(s)) for s in range(2)) - before
    ctx.save(phase="catch_up")
    state = _run(ctx, run_catch_up)
    assert state.phase == "switch" and _stored(store) == state
    assert state.positions == logs.tails(store, G1)
    assert sum(state.replayed.values()) == written  # every entry since P0, once
    replayed = folded(store, G2)
    assert set(replayed) == {"d3", "d70", "d71"}  # d5's delete leaves nothing alive
    assert all(replayed[d.doc_id][2] == expected(d) for d in late)
    assert [c[1] for c in changes(store, G2) if c[0] == "d5"] == ["d"]  # only its delete


def test_catch_up_appends_a_run_of_single_document_writes_in_one_script_in_order(
    store: Any, tmp_path: Path, redis_url: str
) -> None:
    """The gateway logs most writes as one document an entry: the replay appends a run of
    them (one op, no id twice) in one script of up to SCRIPT_ITEMS, not a script each (a
    round trip and an AOF write a document: the catch-up's cost). An id written again, or
    the other op, starts a new run: each document's changes keep the source's order."""
    from services.generations.append import SCRIPT_ITEMS

    ctx = _context(store, tmp_path, "p0", batch=64)
    _run(ctx, run_p0)
    before = sum(store.xlen(G1.log(s)) for s in range(2))

    async def writes() -> None:
        await write_async(redis_url, G1, [doc(i, "one") for i in range(100, 140)], batch=1)
        await write_async(redis_url, G1, [doc(105, "again")], deletes=["d110"], batch=1)
        await write_async(redis_url, G1, [doc(110, "back")], batch=1)

    asyncio.run(writes())
    written = sum(store.xlen(G1.log(s)) for s in range(2)) - before
    assert written == 43  # one entry a write
    ctx.save(phase="catch_up")
    state = _run(ctx, run_catch_up)
    assert sum(state.replayed.values()) == written
    appended = sum(store.xlen(G2.log(s)) for s in range(2))
    # per shard: the first 40 in runs of SCRIPT_ITEMS, then d105 again, the delete, d110 back
    assert appended <= 2 * -(-40 // (2 * SCRIPT_ITEMS)) + 2 + 3, appended
    logged = changes(store, G2)
    assert [(op, v) for i, op, v in logged if i == "d105"] == [("u", 1), ("u", 2)]
    assert [op for i, op, _ in logged if i == "d110"] == ["u", "d", "u"]
    replayed = folded(store, G2)
    assert set(replayed) == {f"d{i}" for i in range(100, 140)}
    assert replayed["d105"][2] == expected(doc(105, "again"))
    assert replayed["d110"][2] == expected(doc(110, "back"))
    assert all(replayed[f"d{i}"][2] == expected(doc(i, "one")) for i in (100, 139))


@pytest.mark.parametrize("factor", [4.0, None])
def test_catch_up_replays_within_its_bound_unless_off(
    store: Any, tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch, factor: Any
) -> None:
    """Each batch of the catch-up's replay passes through its rate bound (the batch's
    entries, the write rate then); ``--catch-up-factor off`` replays flat out."""
    from services.generations.phase_catch_up import ReplayBound

    paced: list[tuple[int, float, float]] = []

    async def after(self: ReplayBound, entries: int, write_rate: float) -> None:
        paced.append((entries, self.factor, self.floor))

    monkeypatch.setattr(ReplayBound, "after", after)
    ctx = _context(store, tmp_path, "p0", batch=1, catch_up_factor=factor, catch_up_floor=30.0)
    _run(ctx, run_p0)
    write(redis_url, G1, [doc(i, "late") for i in range(80, 100)])
    ctx.save(phase="catch_up")
    state = _run(ctx, run_catch_up)
    assert state.phase == "switch"
    if factor is None:
        assert paced == []
    else:
        assert [n for n, _, _ in paced] == [1] * sum(state.replayed.values())  # each batch
        assert len(paced) > 1
        assert {(f, floor) for _, f, floor in paced} == {(4.0, 30.0)}


class CountingEncoders:
    """The hash encoder stand-in, counting every text it is asked to encode."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    async def __call__(self, spec: EncoderSpec) -> Encoder:
        return _Counted(self.texts)


class _Counted(HashEncoder):
    def __init__(self, texts: list[str]) -> None:
        self.seen = texts

    async def encode(self, texts: Sequence[str], kind: Any, timeout: float | None = None) -> Any:
        self.seen.extend(texts)
        return await super().encode(texts, kind, timeout)


def test_catch_up_of_a_retrain_appends_the_logged_vectors_and_encodes_nothing(
    store: Any, tmp_path: Path, redis_url: str
) -> None:
    encoders = CountingEncoders()
    ctx = _context(store, tmp_path, "p0", encoder=SPEC, encoders=encoders)
    _run(ctx, run_p0)
    # vectors no encoder of this test gives their text: only the log has them
    late = [replace(doc(i, "late"), vector=vector(f"logged {i}")) for i in (3, 70, 71)]
    write(redis_url, G1, late, deletes=["d5"])
    ctx.save(phase="catch_up")
    state = _run(ctx, run_catch_up)
    assert state.phase == "switch" and state.positions == logs.tails(store, G1)
    assert encoders.texts == []  # no encoder call at all
    replayed = folded(store, G2)
    assert set(replayed) == {"d3", "d70", "d71"}
    for d in late:
        assert replayed[d.doc_id][2] == tuple(round(float(x), 4) for x in d.vector)
        assert replayed[d.doc_id][2] != expected(d)


def test_catch_up_to_another_encoder_re_embeds_each_upsert(
    store: Any, tmp_path: Path, redis_url: str
) -> None:
    encoders = CountingEncoders()
    ctx = _context(store, tmp_path, "p0", encoders=encoders)
    _run(ctx, run_p0)
    late = [replace(doc(i, "late"), vector=vector(f"logged {i}")) for i in (3, 70)]
    write(redis_url, G1, late)
    ctx.save(phase="catch_up")
    _run(ctx, run_catch_up)
    assert sorted(encoders.texts) == sorted(embedding_text(d.title, d.text) for d in late)
    assert all(folded(store, G2)[d.doc_id][2] == expected(d) for d in late)


# --- catch-up under writes: the gateway's dual write ----------------------------------


class Salted(HashEncoder):
    """An encoder stand-in per EncoderSpec: the vector of a text is a hash of the text and
    the spec's digest (two encoders, two vectors); counts its texts, fails on "fail"
    when ``failing`` (a Triton version that refuses)."""

    model_name = "hash"

    def __init__(self, spec: EncoderSpec, seen: list[str], failing: bool = False) -> None:
        self.spec, self.seen, self.failing = spec, seen, failing
        self.model_version, self.digest = spec.version, spec.digest

    async def encode(self, texts: Sequence[str], kind: Any, timeout: float | None = None) -> Any:
        if self.failing and any("fail" in t for t in texts):
            raise Unavailable("the target's Triton version refuses")
        self.seen.extend(texts)
        return Embeddings(np.stack([salted(self.spec, t) for t in texts]), [False] * len(texts))


# untitled upserts of the scenario: (number, text)
SECOND_ENCODE = ((3, "x"), (102, "fail the second encode"), (103, "after the abort"))


def salted(spec: EncoderSpec, text: str) -> np.ndarray:
    return vector(f"{spec.digest}:{text}")


def _rounded(v: np.ndarray) -> tuple[float, ...]:
    return tuple(round(float(x), 4) for x in v)


async def _gateway_writes(redis_url: str, gateway_seen: list[str]) -> list[str]:
    """The gateway's GenerationSource and DocumentPipeline over the real registry and
    writer: an upsert before the source's refresh saw the rollout, then (the refresh
    done) upserts with the dual write on, one of them failing its second encode, then
    one after the rollout ended; the dual encodes' outcomes."""
    connection = StoreConnection(redis_url, 2)

    async def bundle(gen: Generation) -> Bundle:
        writer = ChangeLogWriter(connection, DIM, keys=gen.keys(2))
        return Bundle(gen.name, Salted(gen.encoder, []), *[object()] * 3, writer)  # type: ignore[arg-type, call-arg]

    async def encoders(gen: Generation) -> tuple[Encoder, bool]:
        return Salted(gen.encoder, gateway_seen, failing=True), True

    outcomes: list[str] = []
    # no background refresh: the test runs the refresh's steps itself
    source = GenerationSource(
        RedisAliasReader(connection.redis), bundle, refresh_s=3600, encoders=encoders
    )
    pipeline = DocumentPipeline(source, on_dual=outcomes.append)
    try:
        await source.start()
        await pipeline.upsert([Document("d100", "before", "title 100")], 5.0)
        await source.prepare_target()  # the refresh that reads the rollout
        assert source.dual.current("g1") is not None and source.dual.current("g2") is None
        await pipeline.upsert(
            [Document("d101", "during", "title 101"), Document("d3", SECOND_ENCODE[0][1])], 5.0
        )
        await pipeline.upsert([Document("d102", SECOND_ENCODE[1][1])], 5.0)
        Registry(sync_client(redis_url)).set_state("g2", "failed")  # as an abort leaves it
        await source.prepare_target()
        assert source.dual.current("g1") is None
        await pipeline.upsert([Document("d103", SECOND_ENCODE[2][1])], 5.0)
    finally:
        await source.close()
        await connection.close()
    return outcomes


def test_catch_up_takes_the_dual_writes_vectors_and_re_embeds_only_the_others(
    store: Any, tmp_path: Path, redis_url: str
) -> None:
    builder_seen: list[str] = []

    async def builder_encoders(spec: EncoderSpec) -> Encoder:
        return Salted(spec, builder_seen)

    ctx = _context(store, tmp_path, "p0", encoders=builder_encoders)
    _run(ctx, run_p0)
    gateway_seen: list[str] = []
    outcomes = asyncio.run(_gateway_writes(redis_url, gateway_seen))
    assert outcomes == ["encoded", "failed"]
    entries = [f for s in range(2) for _, f in store.xrange(G1.log(s))]
    tagged = {i for f in entries if f.get(b"tenc") for i in json.loads(f[b"ids"])}
    assert tagged == {"d101", "d3"}  # the entries written while the dual write was on
    Registry(store).set_state("g2", "building")  # the catch-up of the rollout as it ran
    ctx.save(phase="catch_up")
    state = _run(ctx, run_catch_up)
    assert state.phase == "switch"
    text = {i: embedding_text(f"title {i}", t) for i, t in ((100, "before"), (101, "during"))}
    text |= {i: embedding_text("", t) for i, t in SECOND_ENCODE}
    # re-embedded: written before the dual write, its second encode failed, or after
    assert sorted(builder_seen) == sorted(text[i] for i in (100, 102, 103))
    assert sorted(gateway_seen) == sorted([text[101], text[3]])
    replayed = folded(store, G2)
    for i in (100, 101, 3, 102, 103):  # every one with the target encoder's vector
        assert replayed[f"d{i}"][2] == _rounded(salted(NEW, text[i])), i
        assert replayed[f"d{i}"][2] != _rounded(salted(SPEC, text[i]))


def test_a_rollout_holding_more_entries_than_its_bound_is_aborted_and_releases_its_hold(
    store: Any, tmp_path: Path, redis_url: str
) -> None:
    ctx = _context(store, tmp_path, "p0", max_held_entries=3)
    _run(ctx, run_p0)
    for i in range(4):  # 4 writes after P0, each an entry of its shard's log
        write(redis_url, G1, [doc(i, "written during the bulk")])
    ctx.save(phase="bulk")
    with pytest.raises(HeldEntriesExceeded, match="held 4 entries of g1's logs, more than"):
        _run(ctx, run_bulk)
    registry = Registry(store)
    assert RolloutStore(store).load() is None  # the rollout ended
    assert registry.get("g2").state == "failed" and "max held" in registry.get("g2").note
    assert all(store.hget(G1.snapshots(s), "rollout:g2") is None for s in range(2))
    assert {registry.gate(G1.layout, s) for s in range(2)} == {"g1"}
    assert registry.alias().serving == "g1"


def test_within_its_bound_the_same_rollout_goes_on(
    store: Any, tmp_path: Path, redis_url: str
) -> None:
    ctx = _context(store, tmp_path, "p0", max_held_entries=4)
    _run(ctx, run_p0)
    for i in range(4):
        write(redis_url, G1, [doc(i, "written during the bulk")])
    ctx.save(phase="bulk")
    assert _run(ctx, run_bulk).phase == "catch_up"


def _ready_to_switch(store: Any, tmp_path: Path, **options: Any) -> RolloutContext:
    """A rollout past its catch-up: P0 recorded, the positions at the source's tails."""
    ctx = _context(store, tmp_path, "p0", **options)
    _run(ctx, run_p0)
    Registry(store).set_state("g2", "catching_up", params={"trained": True})
    ctx.save(phase="switch")
    return ctx


def test_switch_replays_the_last_writes_then_moves_the_alias_and_the_gates(
    store: Any, tmp_path: Path, redis_url: str
) -> None:
    ctx = _ready_to_switch(store, tmp_path)
    write(redis_url, G1, [doc(80, "last")])  # after the catch-up, before the switch
    store.hset(G1.late_vectors(1, "g2"), "1-0", b"\0" * 4 * DIM)  # a late dual encode's rows
    state = _run(ctx, run_switch)
    registry = Registry(store)
    alias = registry.alias()
    assert (alias.serving, alias.previous) == ("g2", "g1")
    assert registry.get("g2").state == "serving" and registry.get("g1").state == "previous"
    assert {registry.gate(G2.layout, s) for s in range(2)} == {"g2"}
    assert "d80" in folded(store, G2)
    assert state.phase == "done"
    switch_in = registry.get("g2").switch_in
    for shard in range(2):
        assert store.hget(G2.snapshots(shard), "rollback:g1") == switch_in[str(shard)].encode()
        assert store.hget(G1.snapshots(shard), "rollout:g2") is None  # released
    assert not store.exists(G1.late_vectors(1, "g2"))  # gone with the rollout


@pytest.mark.parametrize(("replayed_per_s", "lifted"), [(5, True), (100, False)])
def test_a_catch_up_that_does_not_gain_lifts_the_local_stacks_pause_of_the_rollout(
    store: Any, tmp_path: Path, redis_url: str, monkeypatch: Any, replayed_per_s: int, lifted: bool
) -> None:
    """While the replay is no faster than the writes the builder renews a short-lived
    record that the local stack reads as "pause none of the rollout's processes"
    (services/process/hold.py): a held catch-up that cannot outrun the writers would
    otherwise never finish."""
    ctx = _context(store, tmp_path, "p0")
    _run(ctx, run_p0)
    write(redis_url, G1, [doc(i, "late") for i in range(40)])
    ctx.save(phase="catch_up")
    got = lag_and_added(ctx)
    assert got is not None
    lag, added = got
    now = [1000.0]
    monkeypatch.setattr("services.generations.progress.time.monotonic", lambda: now[0])
    ctx.progress = Progress()
    ctx.progress.phase("catch_up")
    for second in range(5):  # the source written at 20 entries/s for 5 s
        now[0] = 1000.0 + second
        ctx.progress.advance(replayed_per_s if second else 0)
        ctx.progress.catch_up(lag, added - 20 * (5 - second))
    now[0] = 1005.0
    ctx.progress.advance(replayed_per_s)
    report(ctx, bounded=False)
    assert (store.get(HOLD_LIFTED_KEY) == b"g2") is lifted
    if lifted:
        assert 0 < store.ttl(HOLD_LIFTED_KEY) <= HOLD_LIFTED_S


def test_the_catch_up_ends_only_once_the_target_replicas_applied_its_logs(
    store: Any, tmp_path: Path, redis_url: str
) -> None:
    """T's replicas apply their backlog while the catch-up holds them on the rollout's CPU
    budget (the local stack hands them over to serving's CPUs in the switch phase): the
    phase stays ``catch_up`` until they serve and applied T's logs, the writes open and
    replayed meanwhile."""
    polls: list[str] = []
    applied: dict[int, str] = {}

    async def replicas_starting(spec: str) -> list[list[str | None]]:
        polls.append(Registry(store).running().phase)  # type: ignore[union-attr]
        if len(polls) == 2:  # a write while they start: replayed before the phase ends
            await write_async(redis_url, G1, [doc(90, "while T's replicas start")])
        answer: list[list[str | None]] = [[None], [None]]  # not serving yet
        if len(polls) > 3:
            answer = [[applied.get(s)] for s in range(2)]
        applied.update(logs.tails(store, G2))
        return answer

    ctx = _context(
        store, tmp_path, "p0", applied=replicas_starting, wait_for_shards=True, shard_wait_s=10
    )
    _run(ctx, run_p0)
    Registry(store).set_addresses("g2", "127.0.0.1:1;127.0.0.1:2")
    ctx.save(phase="catch_up")
    state = _run(ctx, run_catch_up)
    assert state.phase == "switch"
    assert len(polls) > 3 and set(polls) == {"catch_up"}, polls
    assert "d90" in folded(store, G2)
    assert {Registry(store).gate(G1.layout, s) for s in range(2)} == {"g1"}  # never closed


def test_switch_gives_the_writes_back_when_the_target_replicas_lag(
    store: Any, tmp_path: Path
) -> None:
    async def never_applied(spec: str) -> list[list[str | None]]:
        return [[None], [None]]

    ctx = _ready_to_switch(
        store,
        tmp_path,
        applied=never_applied,
        wait_for_shards=True,
        shard_wait_s=0.3,
        switch_attempts=2,
    )
    Registry(store).set_addresses("g2", "127.0.0.1:1;127.0.0.1:2")
    with pytest.raises(Unavailable, match="did not catch up in 2 attempts"):
        _run(ctx, run_switch)
    registry = Registry(store)
    assert registry.alias().serving == "g1"
    assert {registry.gate(G1.layout, s) for s in range(2)} == {"g1"}
    assert CLOSED not in {registry.gate(G1.layout, s) for s in range(2)}
    assert registry.get("g2").state == "catching_up"


def test_switch_closes_the_writes_only_once_the_target_replicas_serve(
    store: Any, tmp_path: Path, redis_url: str
) -> None:
    """T's shard processes start once it is trained and take seconds to serve: the switch
    waits for them with the source's writes open (they were closed all that while: every
    write paused 2 s at test_generations_e2e's reshard)."""
    gates_seen: list[set[str]] = []
    applied: dict[int, str] = {}

    async def replicas_starting(spec: str) -> list[list[str | None]]:
        """Not serving for 3 polls; then each poll applies what T's logs held at the
        poll before, while a write arrives on S between polls (the replicas are always a
        step behind the newest tails, as running replicas are)."""
        gates_seen.append({Registry(store).gate(G1.layout, s) for s in range(2)})
        if gates_seen[-1] == {"g1"}:
            await write_async(redis_url, G1, [doc(200 + len(gates_seen), "meanwhile")])
        answer: list[list[str | None]] = [[None], [None]]  # not serving yet
        if len(gates_seen) > 3:
            answer = [[applied.get(s)] for s in range(2)]
        applied.update(logs.tails(store, G2))
        return answer

    ctx = _ready_to_switch(
        store, tmp_path, applied=replicas_starting, wait_for_shards=True, shard_wait_s=10
    )
    Registry(store).set_addresses("g2", "127.0.0.1:1;127.0.0.1:2")
    _run(ctx, run_switch)
    assert Registry(store).alias().serving == "g2"
    assert gates_seen[:3] == [{"g1"}] * 3, f"the writes were closed while T started: {gates_seen}"
    # and closed as soon as the replicas serve, though the writes go on meanwhile
    assert gates_seen.index({CLOSED}) <= 5, gates_seen


# --- rollback, abort, retire -----------------------------------------------------------


def _switched(store: Any, tmp_path: Path) -> None:
    """g2 serves (switched by the switch phase), the rollout ended."""
    _run(_ready_to_switch(store, tmp_path), run_switch)
    Registry(store).end_rollout()


def test_rollback_replays_the_writes_since_the_switch_into_the_previous_generation(
    store: Any, tmp_path: Path, redis_url: str
) -> None:
    _switched(store, tmp_path)
    since = [doc(90, "after the switch")]
    write(redis_url, G2, since, deletes=["d1"])
    builder = RolloutBuilder(
        store, hash_encoders, RolloutOptions(index_root=tmp_path, batch=8, wait_for_shards=False)
    )
    serving = asyncio.run(builder.rollback())
    registry = Registry(store)
    assert serving.name == "g1"
    assert (registry.alias().serving, registry.alias().previous) == ("g1", "g2")
    in_g1 = folded(store, G1)
    assert in_g1["d90"][2] == expected(since[0])
    assert "d1" not in in_g1 and "d2" in in_g1
    assert RolloutStore(store).load() is None


def test_the_builder_asks_for_the_stacks_placement_before_each_phase(
    store: Any, tmp_path: Path, monkeypatch: Any
) -> None:
    """:func:`~services.generations.stack_placed.placed` is the builder's, before every
    phase it runs (here a rollback's catch-up and switch)."""
    _switched(store, tmp_path)
    asked: list[str] = []

    async def placed(ctx: RolloutContext, phase: str) -> None:
        asked.append(phase)

    monkeypatch.setattr(stack_placed, "placed", placed)
    builder = RolloutBuilder(
        store, hash_encoders, RolloutOptions(index_root=tmp_path, batch=8, wait_for_shards=False)
    )
    asyncio.run(builder.rollback())
    assert asked == ["catch_up", "switch"]


def test_a_budgeted_phase_begins_only_once_the_local_stack_holds_the_rollout(
    store: Any, tmp_path: Path
) -> None:
    """With a CPU budget recorded, a phase begins only once the stack's pass names its
    target in ``{gtr}:cpu-placed`` (its processes pinned and listed, the CLI too, for the
    gateway's pause while searches run): a retrain's training began up to a poller pass
    before the pause, and every search in flight then stalled."""
    ctx = _context(store, tmp_path, "train", hand_over_s=30.0)
    store.set(CPU_BUDGET_KEY, "1", ex=60)
    store.set(CPU_PLACED_KEY, "", ex=60)  # the stack's passes before it read the rollout
    waiting: list[bool] = []

    async def go() -> None:
        task = asyncio.create_task(stack_placed.placed(ctx, "train"))
        for _ in range(4):
            await asyncio.sleep(0.1)
            waiting.append(not task.done())
        store.set(CPU_PLACED_KEY, "g2", ex=60)  # the pass that placed and listed them
        await asyncio.wait_for(task, 5.0)

    asyncio.run(go())
    assert waiting == [True] * 4


@pytest.mark.parametrize("case", ["no budget", "handed over", "no stack"])
def test_the_placement_is_not_waited_for_without_a_budget_a_stack_or_after_the_hand_over(
    store: Any, tmp_path: Path, case: str
) -> None:
    """No budget, or the switch (T handed over to serving): at once, whatever the record
    says; a budget no local stack places (no record at all): given up after
    ``NO_STACK_S``, and said, once: the next phase does not wait again."""
    ctx = _context(store, tmp_path, "train", hand_over_s=30.0)
    messages: list[str] = []
    ctx.progress.message = messages.append  # type: ignore[method-assign,assignment]
    if case != "no budget":
        store.set(CPU_BUDGET_KEY, "1", ex=60)
    if case != "no stack":
        store.set(CPU_PLACED_KEY, "", ex=60)  # a stack that never names g2
    phase = "switch" if case == "handed over" else "train"
    bound = stack_placed.NO_STACK_S + 2.0 if case == "no stack" else 0.5
    asyncio.run(asyncio.wait_for(stack_placed.placed(ctx, phase), bound))
    if case == "no stack":  # the next phase: no stack once means none for the rest of the run
        asyncio.run(asyncio.wait_for(stack_placed.placed(ctx, "catch_up"), 0.5))
    said = [m for m in messages if "no local stack placed g2" in m]
    assert len(said) == (1 if case == "no stack" else 0)


def test_abort_gives_the_writes_back_to_the_source_and_fails_the_target(
    store: Any, tmp_path: Path
) -> None:
    ctx = _ready_to_switch(store, tmp_path)
    registry = Registry(store)
    registry.set_gates(G1.layout, CLOSED)  # as a switch that stopped mid-way leaves them
    store.hset("{gtr}:rollout", "pid", "")  # the builder is gone (no pid, no heartbeat)
    store.hset("{gtr}:rollout", "beat", repr(0.0))
    del ctx
    builder = RolloutBuilder(store, hash_encoders, RolloutOptions(index_root=tmp_path))
    aborted = builder.abort()
    assert aborted.target == "g2" and aborted.phase == "switch"
    assert {registry.gate(G1.layout, s) for s in range(2)} == {"g1"}
    assert registry.get("g2").state == "failed" and registry.alias().serving == "g1"
    assert all(store.hget(G1.snapshots(s), "rollout:g2") is None for s in range(2))
    assert RolloutStore(store).load() is None


def test_retire_deletes_the_previous_generations_logs_and_its_rollback_hold(
    store: Any, tmp_path: Path
) -> None:
    _switched(store, tmp_path)
    assert store.exists(G1.log(0)) == 1
    done = retire(store)
    registry = Registry(store)
    assert done.generation.name == "g1" and done.generation.state == "retired"
    assert done.documents_deleted == 0  # g2 shares g1's two-shard layout
    assert not any(store.exists(G1.log(s)) for s in range(2))
    assert not registry.alias().previous
    assert all(store.hget(G2.snapshots(s), "rollback:g1") is None for s in range(2))
    with pytest.raises(FailedPrecondition, match="serving generation"):
        retire(store, "g2")
