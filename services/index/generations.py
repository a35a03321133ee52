"""The registry of index generations in Redis (issue #24; the design: docs/generations.md).

A **generation** is one encoder version, one trained index with its parameters and one
shard count. Its record (:class:`Generation`, JSON in ``{gtr}:gens``) carries its state:

``building`` → ``catching_up`` → ``switching`` → ``serving`` → ``previous`` → ``retired``
(``failed``: an aborted rollout's target, kept for inspection until retired)

The **alias** (``{gtr}:alias``: ``serving``, ``previous``, ``epoch``) names the serving
generation; a switch changes it in one transaction and adds one to the epoch, which write
tokens carry so that a token taken before a switch keeps its meaning after it. At most one
rollout runs at a time (``{gtr}:rollout``, taken with HSETNX). Every registry key carries
the hash tag ``{gtr}``, so on a Redis Cluster they share one slot and a switch is one
MULTI. The per-shard writer gates (``wgen:{s}``, :meth:`Registry.gate`) live in the
slots of the documents they guard, so the writer's script reads them atomically with its
write.

``client`` is a blocking Redis or RedisCluster with bytes replies; the gateway reads the
alias with :func:`read_alias` on its async client.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal, cast

from services.common.errors import FailedPrecondition, NotFound
from services.index.keys import (
    ADDRESSES_KEY,
    ALIAS_KEY,
    CLOSED,
    FIRST_GENERATION,
    GENERATIONS_KEY,
    LAYOUT_KEY,
    NEXT_GENERATION_KEY,
    ROLLOUT_KEY,
    GenerationKeys,
    Layout,
)

State = Literal["building", "catching_up", "switching", "serving", "previous", "retired", "failed"]
STATES: tuple[str, ...] = (
    "building",
    "catching_up",
    "switching",
    "serving",
    "previous",
    "retired",
    "failed",
)
# States whose shards run (the local stack and the chart keep their replicas up).
RUNNING: frozenset[str] = frozenset({"building", "catching_up", "switching", "serving", "previous"})


@dataclass(frozen=True)
class EncoderSpec:
    """Which encoder a generation's vectors come from: Triton's model and version, its
    width, and the digest of the weights (the query cache and the rollout compare
    generations by it). Version 0 = recorded without one (before any ``encoder publish``,
    e.g. by a shard from its manifest): the repository's first version, 1. Never "the
    newest": after a publish that is another encoder (docs/generations.md)."""

    model: str
    version: int = 0
    dim: int = 0
    digest: str = ""
    source: str = ""  # the checkpoint folder it was exported from, for the record


@dataclass(frozen=True)
class Generation:
    name: str
    state: str
    num_shards: int
    encoder: EncoderSpec
    index_dir: str
    params: dict[str, Any] = field(default_factory=dict)
    created_at: float = 0.0
    serving_since: float | None = None
    # This generation's log positions at its last switch-in: a write token of any older
    # epoch is covered once these are applied (every write before the switch is in them).
    switch_in: dict[str, str] = field(default_factory=dict)
    note: str = ""

    @property
    def number(self) -> int:
        return generation_number(self.name)

    def keys(self, base: int) -> GenerationKeys:
        return GenerationKeys(self.name, Layout(self.num_shards, base))

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: bytes | str) -> Generation:
        data = json.loads(raw)
        data["encoder"] = EncoderSpec(**data["encoder"])
        return cls(**data)


@dataclass(frozen=True)
class Alias:
    serving: str
    epoch: int
    previous: str | None = None


def generation_number(name: str) -> int:
    if not name.startswith("g") or not name[1:].isdigit():
        raise ValueError(f"{name!r} is not a generation name (g1, g2, ...)")
    return int(name[1:])


# The rollout lock and its fields in one step; ARGV[1] the target ("" = the next name).
_BEGIN_ROLLOUT = """
if redis.call('EXISTS', KEYS[1]) == 1 then return false end
local target = ARGV[1]
if target == '' then target = 'g' .. redis.call('INCR', KEYS[2]) end
redis.call('HSET', KEYS[1], 'target', target, unpack(ARGV, 2))
return target
"""


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _alias(raw: Mapping[Any, Any]) -> Alias | None:
    data = {_s(k): _s(v) for k, v in raw.items()}
    if "serving" not in data:
        return None
    return Alias(data["serving"], int(data.get("epoch", "1")), data.get("previous") or None)


async def read_alias(client: Any) -> Alias | None:
    """The alias, on an async client (the gateway's); None before a first generation."""
    return _alias(await client.hgetall(ALIAS_KEY))


async def read_generation(client: Any, name: str) -> Generation:
    raw = await client.hget(GENERATIONS_KEY, name)
    if raw is None:
        raise NotFound(f"generation {name!r} does not exist")
    return Generation.from_json(raw)


async def read_addresses(client: Any, name: str) -> str | None:
    raw = await client.hget(ADDRESSES_KEY, name)
    return None if raw is None else _s(raw)


class Registry:
    """Generations, the alias, the rollout lock and the writer gates (blocking client)."""

    def __init__(self, client: Any) -> None:
        self.redis: Any = client

    # --- reading ------------------------------------------------------------------------

    def base_shards(self) -> int:
        raw = self.redis.hget(LAYOUT_KEY, "shards")
        if raw is None:
            raise FailedPrecondition("the store has no key layout yet (start a gateway or shard)")
        return int(_s(raw))

    def get(self, name: str) -> Generation:
        raw = self.redis.hget(GENERATIONS_KEY, name)
        if raw is None:
            raise NotFound(f"generation {name!r} does not exist")
        return Generation.from_json(raw)

    def all(self) -> list[Generation]:
        gens = [Generation.from_json(v) for v in self.redis.hgetall(GENERATIONS_KEY).values()]
        return sorted(gens, key=lambda g: g.number)

    def alias(self) -> Alias:
        alias = _alias(self.redis.hgetall(ALIAS_KEY))
        if alias is None:
            raise FailedPrecondition("no generation serves yet (the store is empty)")
        return alias

    def serving(self) -> Generation:
        return self.get(self.alias().serving)

    def keys(self, gen: Generation) -> GenerationKeys:
        return gen.keys(self.base_shards())

    def addresses(self, name: str) -> str | None:
        raw = self.redis.hget(ADDRESSES_KEY, name)
        return None if raw is None else _s(raw)

    # --- writing ------------------------------------------------------------------------

    def ensure_first(self, num_shards: int, encoder: EncoderSpec, index_dir: str) -> Generation:
        """Generation g1, serving, for a store that has none yet (idempotent: whoever comes
        first records it; a store written before generations existed becomes g1)."""
        first = Generation(
            FIRST_GENERATION,
            "serving",
            num_shards,
            encoder,
            index_dir,
            created_at=time.time(),
            serving_since=time.time(),
        )
        pipe = self.redis.pipeline(transaction=True)
        pipe.hsetnx(GENERATIONS_KEY, first.name, first.to_json())
        pipe.hsetnx(ALIAS_KEY, "serving", first.name)
        pipe.hsetnx(ALIAS_KEY, "epoch", "1")
        pipe.execute()
        # The counter is only ever raised: max(next, 1).
        self.redis.eval(
            "local n = tonumber(redis.call('GET', KEYS[1]) or '0') "
            "if n < 1 then redis.call('SET', KEYS[1], 1) end return 1",
            1,
            NEXT_GENERATION_KEY,
        )
        return self.get(first.name)

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
                    alias = _alias(pipe.hgetall(ALIAS_KEY))
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
        """Take the rollout lock with ``fields`` recorded in the same step (no reader sees
        a lock without them). Without a ``target`` in ``fields`` the next generation
        name is taken in that step too, so a refused rollout uses none up. The target's
        name; FailedPrecondition naming the running rollout when the lock is taken."""
        rest = [x for k, v in fields.items() if k != "target" for x in (k, v)]
        target = self.redis.eval(
            _BEGIN_ROLLOUT, 2, ROLLOUT_KEY, NEXT_GENERATION_KEY, fields.get("target", ""), *rest
        )
        if target is None:
            running = self.rollout() or {}
            raise FailedPrecondition(
                f"a rollout to {running.get('target', '?')} is running (phase "
                f"{running.get('phase', '?')}): resume it with `index rollout` again, or "
                "`index rollout --abort`"
            )
        return _s(target)

    def rollout(self) -> dict[str, str] | None:
        raw = self.redis.hgetall(ROLLOUT_KEY)
        return {_s(k): _s(v) for k, v in raw.items()} or None

    def update_rollout(self, **fields: str) -> None:
        self.redis.hset(ROLLOUT_KEY, mapping=fields)

    def end_rollout(self) -> None:
        self.redis.delete(ROLLOUT_KEY)

    # --- writer gates -------------------------------------------------------------------

    def gate(self, layout: Layout, shard: int) -> str:
        """The generation taking the writes of ``layout``'s shard (:data:`CLOSED`: none)."""
        raw = self.redis.get(layout.gate(shard))
        if raw is None:
            return FIRST_GENERATION if layout.num_shards == layout.base else CLOSED
        return _s(raw)

    def set_gates(self, layout: Layout, value: str) -> None:
        """Every shard of ``layout`` to ``value`` (a generation name or :data:`CLOSED`);
        one slot per shard, so on a cluster one SET each, in shard order."""
        for shard in range(layout.num_shards):
            self.redis.set(layout.gate(shard), value)


def _need(raw: bytes | None, name: str) -> bytes:
    if raw is None:
        raise NotFound(f"generation {name!r} does not exist")
    return raw


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
