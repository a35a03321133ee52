"""The registry of index generations (services/generations/registry.py) and the key names of
other layouts and generations (services/index/keys.py), on a real Redis and a real
Redis Cluster."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from services.common.errors import FailedPrecondition, NotFound
from services.generations.registry import EncoderSpec, Registry, read_alias
from services.index.keys import (
    CLOSED,
    GenerationKeys,
    Layout,
    doc_key,
    log_key,
    snapshot_positions_key,
    version_key,
)
from services.process.redis_client import async_client
from tests.support.generation_logs import two_shard_store

MINILM = EncoderSpec("embed", 1, 384, "digest-1")


@pytest.fixture
def client(any_redis_url: str) -> Iterator[Any]:
    with two_shard_store(any_redis_url) as c:
        yield c


def test_the_first_generation_and_base_layout_keep_the_keys_of_a_store_without_generations() -> (
    None
):
    g1 = GenerationKeys("g1", Layout(2, base=2))
    assert [g1.log(s) for s in range(2)] == [log_key(0), log_key(1)]
    assert g1.snapshots(1) == snapshot_positions_key(1)
    assert g1.layout.doc("a") == doc_key(g1.layout.shard("a"), "a")
    assert g1.layout.version("a") == version_key(g1.layout.shard("a"), "a")


def test_other_generations_and_shard_counts_get_keys_of_their_own() -> None:
    g2 = GenerationKeys("g2", Layout(2, base=2))
    g3 = GenerationKeys("g3", Layout(3, base=2))
    assert g2.log(0) == "log:{0}:g2" and g2.layout.doc("x").startswith("doc:{")
    assert g2.layout.doc("x") == GenerationKeys("g1", Layout(2, 2)).layout.doc("x")  # shared
    assert g3.log(2) == "log:{3.2}:g3"
    assert g3.layout.doc("x") == f"doc:{{3.{g3.layout.shard('x')}}}:x"
    assert g3.logged(0) == "lv:{3.0}:g3"
    # A document's keys and its shard's log share one hash tag (one cluster slot).
    tag = g3.layout.tag(g3.layout.shard("x"))
    assert tag in g3.log(g3.layout.shard("x")) and tag in g3.layout.version("x")


def test_a_first_generation_is_recorded_once_and_serves(client: Any, any_redis_url: str) -> None:
    reg = Registry(client)
    first = reg.ensure_first(2, MINILM, "/idx/g1")
    again = reg.ensure_first(5, EncoderSpec("other"), "/elsewhere")  # a later starter
    assert first == again and first.state == "serving" and first.num_shards == 2
    assert reg.alias().serving == "g1" and reg.alias().epoch == 1
    assert asyncio.run(_alias_async(any_redis_url)) == reg.alias()


async def _alias_async(url: str) -> Any:
    """The alias as the gateway reads it: on its async client."""
    aclient = async_client(url, max_connections=2, pool_timeout_s=5.0)
    try:
        return await read_alias(aclient)
    finally:
        await aclient.aclose()


def test_a_switch_is_one_alias_change_that_raises_the_epoch(client: Any) -> None:
    reg = Registry(client)
    reg.ensure_first(2, MINILM, "/idx/g1")
    g2 = reg.create(3, EncoderSpec("embed", 2, 384, "digest-2"), "/idx/g2", {"nprobe": 8})
    assert g2.name == "g2" and g2.state == "building"
    alias = reg.switch("g2", {0: "5-0", 1: "6-0", 2: "7-0"})
    assert alias.serving == "g2" and alias.previous == "g1" and alias.epoch == 2
    assert reg.get("g2").state == "serving" and reg.get("g2").switch_in == {
        "0": "5-0",
        "1": "6-0",
        "2": "7-0",
    }
    assert reg.get("g1").state == "previous"
    back = reg.switch("g1", {0: "9-0", 1: "9-1"})
    assert (back.serving, back.previous, back.epoch) == ("g1", "g2", 3)
    assert [g.name for g in reg.all()] == ["g1", "g2"]
    assert reg.create(2, MINILM, "/idx/g3", {}).name == "g3"  # names never reused


def test_one_rollout_at_a_time(client: Any) -> None:
    reg = Registry(client)
    reg.begin_rollout({"target": "g2", "phase": "bulk"})
    with pytest.raises(FailedPrecondition, match="rollout to g2 is running"):
        reg.begin_rollout({"target": "g3", "phase": "start"})
    running = reg.running()
    assert running is not None and (running.target, running.phase) == ("g2", "bulk")
    reg.end_rollout()
    reg.begin_rollout({"target": "g3", "phase": "start"})
    running = reg.running()
    assert running is not None and running.target == "g3"


def test_a_rollout_takes_the_next_name_with_the_lock_and_a_refused_one_takes_none(
    client: Any,
) -> None:
    reg = Registry(client)
    reg.ensure_first(2, MINILM, "/idx/g1")
    name = reg.begin_rollout({"source": "g1", "phase": "create"})
    running = reg.running()
    assert name == "g2" and running is not None
    assert (running.target, running.source, running.phase) == ("g2", "g1", "create")
    for _ in range(3):  # refused while g2's runs: no number used up
        with pytest.raises(FailedPrecondition, match="rollout to g2 is running"):
            reg.begin_rollout({"source": "g1", "phase": "create"})
    reg.end_rollout()
    assert reg.begin_rollout({"source": "g1", "phase": "create"}) == "g3"


def test_writer_gates_default_to_g1_on_the_base_layout_and_closed_elsewhere(client: Any) -> None:
    reg = Registry(client)
    base, other = Layout(2, 2), Layout(3, 2)
    assert reg.gate(base, 0) == "g1" and reg.gate(other, 2) == CLOSED
    reg.set_gates(base, CLOSED)
    reg.set_gates(other, "g3")
    assert [reg.gate(base, s) for s in range(2)] == [CLOSED, CLOSED]
    assert [reg.gate(other, s) for s in range(3)] == ["g3"] * 3


def test_unknown_generations_and_an_empty_registry_are_clear_errors(client: Any) -> None:
    reg = Registry(client)
    with pytest.raises(FailedPrecondition, match="no generation serves"):
        reg.alias()
    with pytest.raises(NotFound, match="g9"):
        reg.get("g9")
