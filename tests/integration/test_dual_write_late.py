"""A dual encode that ends after its upsert was written is kept beside the log entry, and
the rollout's catch-up takes it instead of encoding the document again
(services/index/client/late_vectors.py; docs/generations.md, "Catch-up under writes").

Before, a dual encode past its bound was thrown away: the write was logged without the
target's vectors and the catch-up re-embedded it, the same encode twice on the rollout's
busiest process; in a slow period of this VM that was 3,327 of 20,656 writes, and the
re-embedding of them was most of a 697-s catch-up. Real Redis, registry, writer, gateway
pipeline and catch-up; the encoders are the hash stand-ins of test_rollout_phases."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from services.common.domain import Document
from services.common.encoder_spec import EncoderSpec
from services.common.errors import Unavailable
from services.encoder.base import Embeddings, Encoder
from services.gateway import document_pipeline, dual_write
from services.gateway.document_pipeline import DocumentPipeline
from services.gateway.generation_parts import Bundle, RedisAliasReader
from services.gateway.generations import GenerationSource
from services.generations.builder import RolloutBuilder
from services.generations.context import RolloutOptions
from services.generations.encoding import embedding_text
from services.generations.phase_catch_up import run_catch_up
from services.generations.phase_publish import run_p0
from services.generations.registry import Generation, Registry
from services.index.client.connection import StoreConnection
from services.index.client.writer import ChangeLogWriter
from tests.integration.test_rollout_phases import NEW, Salted, _context, _rounded, _run, salted
from tests.support.generation_logs import folded
from tests.support.hash_store import DIM, G1, G2, g1_store, hash_encoders

# two documents on two shards (one log entry each) and one alone; the second encode of
# the text with "fails" is refused once it is let go
LATE = {"d300": "late one", "d303": "late two", "d302": "late and fails"}


class LetGo(Salted):
    """The rollout target's encoder: every encode waits until ``let_go`` is set."""

    def __init__(self, spec: EncoderSpec, seen: list[str]) -> None:
        super().__init__(spec, seen)
        self.let_go = asyncio.Event()
        self.calls: list[asyncio.Task[Any] | None] = []  # the tasks its encodes ran in

    async def encode(self, texts: Sequence[str], kind: Any, timeout: float | None = None) -> Any:
        self.calls.append(asyncio.current_task())
        await self.let_go.wait()
        if any("fails" in t for t in texts):
            raise Unavailable("the target's Triton version refuses")
        self.seen.extend(texts)
        return Embeddings(np.stack([salted(self.spec, t) for t in texts]), [False] * len(texts))


@pytest.fixture
def store(redis_url: str, tmp_path: Path) -> Iterator[Any]:
    client = g1_store(redis_url, tmp_path)
    yield client
    client.close()


@contextlib.asynccontextmanager
async def _gateway(
    redis_url: str, seen: list[str], outcome: Callable[[str], None]
) -> AsyncIterator[tuple[DocumentPipeline, GenerationSource, list[LetGo]]]:
    """The gateway's GenerationSource and DocumentPipeline over the real registry and
    writer, its dual write on (the refresh done); the target's encoders it made."""
    connection = StoreConnection(redis_url, 2)
    targets: list[LetGo] = []

    async def bundle(gen: Generation) -> Bundle:
        writer = ChangeLogWriter(connection, DIM, keys=gen.keys(2))
        return Bundle(gen.name, Salted(gen.encoder, []), *[object()] * 3, writer)  # type: ignore[arg-type, call-arg]

    async def encoders(gen: Generation) -> tuple[Encoder, bool]:
        targets.append(LetGo(gen.encoder, seen))
        return targets[-1], True

    source = GenerationSource(
        RedisAliasReader(connection.redis), bundle, refresh_s=3600, encoders=encoders
    )
    try:
        await source.start()
        await source.prepare_target()  # the refresh that turns the dual write on
        yield DocumentPipeline(source, on_dual=outcome), source, targets
    finally:
        await source.close()
        await connection.close()


async def _late_writes(redis_url: str, gateway_seen: list[str]) -> dict[str, Any]:
    """Upserts whose second encode is held past its bound: what the write returned before
    the encode was let go, and the outcomes once the late encodes ended."""
    outcomes: list[str] = []
    settled = asyncio.Event()

    def outcome(name: str) -> None:
        outcomes.append(name)
        if len(outcomes) == 2:
            settled.set()

    async with _gateway(redis_url, gateway_seen, outcome) as (pipeline, _, targets):
        first = await pipeline.upsert(
            [Document(i, LATE[i], f"title {i}") for i in ("d300", "d303")], 5.0
        )
        second = await pipeline.upsert([Document("d302", LATE["d302"], "title d302")], 5.0)
        acknowledged_before = list(outcomes)  # both written while their encodes wait
        (target,) = targets
        target.let_go.set()
        await asyncio.wait_for(settled.wait(), 10)
    return {
        "tokens": [first.write_token, second.write_token],
        "before": acknowledged_before,
        "outcomes": outcomes,
    }


def test_a_late_dual_encode_is_kept_and_the_catch_up_takes_it_instead_of_encoding_again(
    store: Any, tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the write waits 50 ms for its second encode (1 s in service): this one is late
    monkeypatch.setattr(document_pipeline, "DUAL_ENCODE_TIMEOUT_S", 0.05)
    builder_seen: list[str] = []

    async def builder_encoders(spec: EncoderSpec) -> Encoder:
        return Salted(spec, builder_seen)

    ctx = _context(store, tmp_path, "p0", encoders=builder_encoders)
    _run(ctx, run_p0)
    Registry(store).set_state("g2", "building")
    gateway_seen: list[str] = []
    out = asyncio.run(_late_writes(redis_url, gateway_seen))
    assert out["before"] == []  # acknowledged without waiting for the held encodes
    assert sorted(out["outcomes"]) == ["failed", "late"]
    entries = {s: store.xrange(G1.log(s)) for s in range(2)}
    assert not any(f.get(b"tenc") for s in entries for _, f in entries[s])  # logged without
    kept = {s: store.hgetall(G1.late_vectors(s, "g2")) for s in range(2)}
    logged = {(s, e.decode()) for s in kept for e in kept[s]}
    first = out["tokens"][0]
    assert logged == {(int(s), e) for s, e in first.items()}, "one kept row set per entry"
    assert len(first) == 2, "the two documents were meant to land on two shards"

    ctx.save(phase="catch_up")
    state = _run(ctx, run_catch_up)
    assert state.phase == "switch"
    text = {i: embedding_text(f"title {i}", t) for i, t in LATE.items()}
    assert builder_seen == [text["d302"]], "only the failed second encode is re-embedded"
    assert sorted(gateway_seen) == sorted([text["d300"], text["d303"]])
    replayed = folded(store, G2)
    for i in LATE:  # each with the target encoder's vector, in its own entry's row
        assert replayed[i][2] == _rounded(salted(NEW, text[i])), i

    # the rollout ends (here aborted): its kept rows go with it
    store.hset("{gtr}:rollout", "pid", "")
    store.hset("{gtr}:rollout", "beat", repr(0.0))
    RolloutBuilder(store, hash_encoders, RolloutOptions(index_root=tmp_path)).abort()
    assert not any(store.exists(G1.late_vectors(s, "g2")) for s in range(2))


def _p0(store: Any, tmp_path: Path) -> None:
    _run(_context(store, tmp_path, "p0"), run_p0)
    Registry(store).set_state("g2", "building")


def test_the_gateway_closing_cancels_its_late_encodes(
    store: Any, tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(document_pipeline, "DUAL_ENCODE_TIMEOUT_S", 0.05)
    _p0(store, tmp_path)
    outcomes: list[str] = []

    async def scenario() -> list[asyncio.Task[Any]]:
        async with _gateway(redis_url, [], outcomes.append) as (pipeline, source, _):
            await pipeline.upsert([Document("d300", LATE["d300"])], 5.0)
            keepers = list(source.dual._late)
            assert len(keepers) == 1, "the late encode goes on after the write"
        return keepers  # closed with the encode never let go: closing must not wait

    keepers = asyncio.run(asyncio.wait_for(scenario(), 10))
    assert all(task.cancelled() for task in keepers)
    assert outcomes == []
    assert not any(store.exists(G1.late_vectors(s, "g2")) for s in range(2))


def test_past_max_late_a_late_encode_is_cancelled_at_its_bound_not_kept(
    store: Any, tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Triton queues late encodes with the builder's calls: while the target's encoder
    cannot keep up, more of them would only hold the builder back, then fail."""
    monkeypatch.setattr(document_pipeline, "DUAL_ENCODE_TIMEOUT_S", 0.05)
    monkeypatch.setattr(dual_write, "MAX_LATE", 1)
    _p0(store, tmp_path)
    outcomes: list[str] = []
    seen: list[str] = []

    async def scenario() -> list[str]:
        async with _gateway(redis_url, seen, outcomes.append) as (pipeline, source, targets):
            await pipeline.upsert([Document("d300", LATE["d300"])], 5.0)
            await pipeline.upsert([Document("d303", LATE["d303"])], 5.0)
            before = list(outcomes)
            keepers = list(source.dual._late)
            assert len(keepers) == 1, f"{len(keepers)} late encodes kept, MAX_LATE is 1"
            targets[0].let_go.set()
            await keepers[0]
        return before

    before = asyncio.run(asyncio.wait_for(scenario(), 10))
    assert before == ["failed"]  # the second, cancelled at its bound
    assert outcomes == ["failed", "late"]
    assert seen == [embedding_text("", LATE["d300"])]  # the cancelled one never ran
    assert store.hlen(G1.late_vectors(0, "g2")) == 1
    assert not store.exists(G1.late_vectors(1, "g2"))


def test_a_late_encode_cancelled_under_its_keeper_counts_as_failed(
    store: Any, tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As when the target's Triton client closes under a call: counted, nothing kept."""
    monkeypatch.setattr(document_pipeline, "DUAL_ENCODE_TIMEOUT_S", 0.05)
    _p0(store, tmp_path)
    outcomes: list[str] = []

    async def scenario() -> None:
        async with _gateway(redis_url, [], outcomes.append) as (pipeline, source, targets):
            await pipeline.upsert([Document("d300", LATE["d300"])], 5.0)
            (keeper,) = source.dual._late
            (call,) = targets[0].calls
            assert call is not None
            call.cancel()
            await keeper

    asyncio.run(asyncio.wait_for(scenario(), 10))
    assert outcomes == ["failed"]
    assert not any(store.exists(G1.late_vectors(s, "g2")) for s in range(2))
