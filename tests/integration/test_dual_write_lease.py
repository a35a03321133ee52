"""The dual write switched off while a dual encode is in flight (the rollout switched or
was aborted): the write goes on and is acknowledged, and the target's encoder is closed
only after that encode ends. Its Triton client was closed at once, which cancelled the
call in flight; the write's handler ended cancelled and its caller waited for its own
deadline (test_generations_e2e, at a switch). Real Redis, registry and writer; the
encoders are stand-ins that, like a grpc.aio client, cancel their calls when closed."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from services.common.domain import Document
from services.common.encoder_spec import EncoderSpec
from services.encoder.base import Embeddings, Encoder
from services.gateway.document_pipeline import DocumentPipeline
from services.gateway.generation_parts import Bundle, RedisAliasReader
from services.gateway.generations import GenerationSource
from services.generations.registry import Generation, Registry
from services.index.client.connection import StoreConnection
from services.index.client.writer import ChangeLogWriter
from tests.support.hash_store import DIM, HashEncoder, g1_store, vector

NEW = EncoderSpec("embed", 2, DIM, "hash-v2", "hash")


class HeldEncoder(HashEncoder):
    """The rollout target's encoder: each encode waits for ``release``; ``close`` cancels
    the encodes in flight (as closing a grpc.aio channel cancels its calls)."""

    model_name = "hash"

    def __init__(self, spec: EncoderSpec) -> None:
        self.model_version, self.digest = spec.version, spec.digest
        self.release = asyncio.Event()
        self.entered = asyncio.Event()
        self.in_flight: set[asyncio.Task[Any]] = set()
        self.closed = False
        self.closed_with_calls = 0

    async def encode(self, texts: Sequence[str], kind: Any, timeout: float | None = None) -> Any:
        task = asyncio.current_task()
        assert task is not None
        self.in_flight.add(task)
        try:
            self.entered.set()
            await self.release.wait()
            return Embeddings(np.stack([vector(f"new:{t}") for t in texts]), [False] * len(texts))
        finally:
            self.in_flight.discard(task)

    async def close(self) -> None:
        self.closed = True
        self.closed_with_calls = len(self.in_flight)
        for task in self.in_flight:
            task.cancel()


@pytest.fixture
def store(redis_url: str, tmp_path: Path) -> Iterator[Any]:
    client = g1_store(redis_url, tmp_path, docs=4)
    yield client
    client.close()


async def _scenario(redis_url: str, registry: Registry, cancel_only: bool) -> dict[str, Any]:
    connection = StoreConnection(redis_url, 2)
    target_encoders: list[HeldEncoder] = []

    async def bundle(gen: Generation) -> Bundle:
        writer = ChangeLogWriter(connection, DIM, keys=gen.keys(2))
        return Bundle(gen.name, HashEncoder(), *[object()] * 3, writer)  # type: ignore[arg-type, call-arg]

    async def encoders(gen: Generation) -> tuple[Encoder, bool]:
        target_encoders.append(HeldEncoder(gen.encoder))
        return target_encoders[-1], True

    outcomes: list[str] = []
    source = GenerationSource(
        RedisAliasReader(connection.redis), bundle, refresh_s=3600, encoders=encoders
    )
    pipeline = DocumentPipeline(source, on_dual=outcomes.append)
    try:
        await source.start()
        target = registry.create(2, NEW, "/idx", {})
        registry.begin_rollout({"target": target.name, "source": "g1"})
        await source.prepare_target()  # the refresh that turns the dual write on
        assert source.dual.current("g1") is not None
        write = asyncio.ensure_future(pipeline.upsert([Document("d9", "during", "t")], 10.0))
        (held,) = target_encoders
        await held.entered.wait()  # the dual encode is in flight
        if cancel_only:  # the call cancelled under it, the dual write still on
            for task in held.in_flight:
                task.cancel()
        else:
            registry.set_state(target.name, "failed")  # the rollout aborted
            await source.prepare_target()  # the refresh that turns the dual write off
            assert source.dual.current("g1") is None
            closed_early = held.closed
            held.release.set()
        result = await write
        return {
            "result": result,
            "outcomes": outcomes,
            "closed_early": False if cancel_only else closed_early,
            "held": held,
        }
    finally:
        await source.close()
        await connection.close()


def test_a_dual_write_switched_off_mid_encode_lets_the_write_finish_then_closes(
    store: Any, redis_url: str
) -> None:
    out = asyncio.run(_scenario(redis_url, Registry(store), cancel_only=False))
    assert out["result"].count == 1, out["result"]  # acknowledged, not cancelled
    assert out["outcomes"] == ["encoded"]
    assert not out["closed_early"], "closed while its dual encode was in flight"
    held = out["held"]
    assert held.closed and held.closed_with_calls == 0


def test_a_dual_encode_cancelled_under_the_write_counts_as_failed_and_the_write_goes_on(
    store: Any, redis_url: str
) -> None:
    out = asyncio.run(_scenario(redis_url, Registry(store), cancel_only=True))
    assert out["result"].count == 1, out["result"]
    assert out["outcomes"] == ["failed"]
