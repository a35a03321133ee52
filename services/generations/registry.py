"""The registry of index generations in Redis (issue #24; the design: docs/generations.md).

The record's format (:class:`Generation`, :class:`Alias`, :class:`EncoderSpec`, the
states) is the index's (:mod:`services.index.records`: a shard reads its own record); this
module changes the registry: new generations, states, the one alias switch, the rollout
lock and the writer gates. A switch changes the alias in one transaction and adds one to
the epoch, which write tokens carry so that a token taken before a switch keeps its
meaning after it. At most one rollout runs at a time (``{gtr}:rollout``, taken in one
script; its fields are :class:`services.generations.state.RolloutState`'s). Every registry
key carries the hash tag ``{gtr}``, so on a Redis Cluster they share one slot and a switch
is one MULTI. The per-shard writer gates (``wgen:{s}``, :meth:`Registry.gate`) live in the
slots of the documents they guard, so the writer's script reads them atomically with its
write.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, cast

from services.common.encoder_spec import EncoderSpec
from services.common.errors import FailedPrecondition, NotFound
from services.generations.state import RolloutState, RolloutStore
from services.index.keys import (
    ADDRESSES_KEY,
    ALIAS_KEY,
    CLOSED,
    FIRST_GENERATION,
    GENERATIONS_KEY,
    LAYOUT_KEY,
    NEXT_GENERATION_KEY,
    GenerationKeys,
    Layout,
)
from services.index.records import (
    RUNNING,
    STATES,
    Alias,
    Generation,
    State,
    ensure_first,
    generation_number,
    get_generation,
    parse_alias,
    read_addresses,
    read_alias,
    read_generation,
    text_of,
)
from services.process.redis_client import SyncRedis

__all__ = [
    "RUNNING",
    "STATES",
    "Alias",
    "EncoderSpec",
    "Generation",
    "Registry",
    "State",
    "describe",
    "generation_number",
    "read_addresses",
    "read_alias",
    "read_generation",
    "shards_run",
]


class Registry:
    """Generations, the alias, the rollout lock and the writer gates (blocking client)."""

    def __init__(self, client: SyncRedis) -> None:
        self.redis: Any = client

    # --- reading ------------------------------------------------------------------------

    def base_shards(self) -> int:
        raw = self.redis.hget(LAYOUT_KEY, "shards")
        if raw is None:
            raise FailedPrecondition("the store has no key layout yet (start a gateway or shard)")
        return int(text_of(raw))

    def get(self, name: str) -> Generation:
        return get_generation(self.redis, name)

    def all(self) -> list[Generation]:
        gens = [Generation.from_json(v) for v in self.redis.hgetall(GENERATIONS_KEY).values()]
        return sorted(gens, key=lambda g: g.number)

    def alias(self) -> Alias:
        alias = parse_alias(self.redis.hgetall(ALIAS_KEY))
        if alias is None:
            raise FailedPrecondition("no generation serves yet (the store is empty)")
        return alias

    def serving(self) -> Generation:
        return self.get(self.alias().serving)

    def keys(self, gen: Generation) -> GenerationKeys:
        return gen.keys(self.base_shards())

    def addresses(self, name: str) -> str | None:
        raw = self.redis.hget(ADDRESSES_KEY, name)
        return None if raw is None else text_of(raw)

    # --- writing ------------------------------------------------------------------------

    def ensure_first(self, num_shards: int, encoder: EncoderSpec, index_dir: str) -> Generation:
        """Generation g1, serving, for a store that has none yet (idempotent)."""
        return ensure_first(self.redis, num_shards, encoder, index_dir)

    def create(
        self, num_shards: int, encoder: EncoderSpec, index_dir: str, params: dict[str, Any]
    ) -> Generation:
        """A new generation in state ``building`` with the next free name."""
        number = int(self.redis.incr(NEXT_GENERATION_KEY))
        gen = Generation(
            f"g{number}",
            "building",
            num_shards,
            encoder,
            index_dir,
            dict(params),
            created_at=time.time(),
        )
        if not self.redis.hsetnx(GENERATIONS_KEY, gen.name, gen.to_json()):
            raise FailedPrecondition(f"generation {gen.name} exists already")
        return gen

    def put(self, gen: Generation) -> Generation:
        self.redis.hset(GENERATIONS_KEY, gen.name, gen.to_json())
        return gen

    def set_state(self, name: str, state: str, **changes: Any) -> Generation:
        if state not in STATES:
            raise ValueError(f"unknown state {state!r}")
        return self.put(replace(self.get(name), state=state, **changes))

    def set_addresses(self, name: str, spec: str) -> None:
        self.redis.hset(ADDRESSES_KEY, name, spec)

    def switch(self, to: str, switch_in: Mapping[int, str]) -> Alias:
        """The one alias change: ``to`` serves from now on (its record's ``switch_in``
        := ``switch_in``), the serving one becomes ``previous``, the epoch goes up by
        one; one MULTI over the registry's slot. The writer gates are the caller's."""
        import redis

        while True:
            with self.redis.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(ALIAS_KEY, GENERATIONS_KEY)
                    alias = parse_alias(pipe.hgetall(ALIAS_KEY))
                    if alias is None:
                        raise FailedPrecondition("no generation serves yet")
                    target = Generation.from_json(_need(pipe.hget(GENERATIONS_KEY, to), to))
                    old = Generation.from_json(
                        _need(pipe.hget(GENERATIONS_KEY, alias.serving), alias.serving)
                    )
                    now = time.time()
                    target = replace(
                        target,
                        state="serving",
                        serving_since=now,
                        switch_in={str(s): p for s, p in switch_in.items()},
                    )
                    pipe.multi()
                    if old.name != to:
                        pipe.hset(
                            GENERATIONS_KEY, old.name, replace(old, state="previous").to_json()
                        )
                    pipe.hset(GENERATIONS_KEY, to, target.to_json())
                    new = Alias(to, alias.epoch + 1, old.name if old.name != to else None)
                    pipe.hset(
                        ALIAS_KEY,
                        mapping={
                            "serving": new.serving,
                            "epoch": str(new.epoch),
                            "previous": new.previous or "",
                        },
                    )
                    pipe.execute()
                    return new
                except redis.WatchError:
                    continue

    # --- the rollout lock ---------------------------------------------------------------

    def begin_rollout(self, fields: Mapping[str, str]) -> str:
        """Take the rollout lock with ``fields`` recorded in the same step
        (:meth:`RolloutStore.begin`); the target's name, FailedPrecondition naming the
        running rollout when the lock is taken."""
        target = RolloutStore(self.redis).begin(fields)
        if target is None:
            raise self.busy()
        return target

    def busy(self) -> FailedPrecondition:
        """The error of a rollout refused because another one holds the lock."""
        running = self.running()
        return FailedPrecondition(
            f"a rollout to {running.target if running else '?'} is running (phase "
            f"{running.phase if running else '?'}): resume it with `index rollout` again, "
            "or `index rollout --abort`"
        )

    def running(self) -> RolloutState | None:
        """The running rollout's record, None when none runs."""
        return RolloutStore(self.redis).load()

    def end_rollout(self) -> None:
        RolloutStore(self.redis).end()

    # --- writer gates -------------------------------------------------------------------

    def gate(self, layout: Layout, shard: int) -> str:
        """The generation taking the writes of ``layout``'s shard (:data:`CLOSED`: none)."""
        raw = self.redis.get(layout.gate(shard))
        if raw is None:
            return FIRST_GENERATION if layout.num_shards == layout.base else CLOSED
        return text_of(raw)

    def set_gates(self, layout: Layout, value: str) -> None:
        """Every shard of ``layout`` to ``value`` (a generation name or :data:`CLOSED`);
        one slot per shard, so on a cluster one SET each, in shard order."""
        for shard in range(layout.num_shards):
            self.redis.set(layout.gate(shard), value)


def _need(raw: bytes | None, name: str) -> bytes:
    if raw is None:
        raise NotFound(f"generation {name!r} does not exist")
    return raw


def shards_run(gen: Generation) -> bool:
    """Whether ``gen``'s shards should run (the local stack's and the chart's rule): a
    running state and a trained index (g1's is trained before it is recorded)."""
    trained = gen.name == FIRST_GENERATION or bool(gen.params.get("trained"))
    return gen.state in RUNNING and trained


def describe(gen: Generation, alias: Alias | None) -> dict[str, Any]:
    """One generation for `index generations` (JSON-ready)."""
    out = cast(dict[str, Any], json.loads(gen.to_json()))
    out["alias"] = (
        "serving"
        if alias and alias.serving == gen.name
        else "previous"
        if alias and alias.previous == gen.name
        else ""
    )
    return out
