"""The generation record as the store keeps it (issue #24; the design: docs/generations.md).

A **generation** is one encoder version, one trained index with its parameters and one
shard count. Its record (:class:`Generation`, JSON in ``{gtr}:gens``) carries its state:

``building`` → ``catching_up`` → ``switching`` → ``serving`` → ``previous`` → ``retired``
(``failed``: an aborted rollout's target, kept for inspection until retired)

The **alias** (``{gtr}:alias``: ``serving``, ``previous``, ``epoch``) names the serving
generation. This module is the record's format and the reads an index shard and the
gateway need (a shard reads its generation's record, the first shard of a store records
g1); every other change of the registry (rollouts, switches, gates) is
:mod:`services.generations.registry`'s, one layer up: the index never imports it.

``client`` is a blocking Redis or RedisCluster with bytes replies; the gateway reads the
alias with :func:`read_alias` on its async client.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from services.common.encoder_spec import EncoderSpec
from services.common.errors import NotFound
from services.common.retrieval_setting import RetrievalSetting
from services.index.keys import (
    ADDRESSES_KEY,
    ALIAS_KEY,
    FIRST_GENERATION,
    GENERATIONS_KEY,
    NEXT_GENERATION_KEY,
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
    # The fusion, candidate depth and reranker chosen for this generation (issue #35;
    # services/common/retrieval_setting.py); None: the gateway's flags, as before it.
    retrieval: RetrievalSetting | None = None

    @property
    def number(self) -> int:
        return generation_number(self.name)

    def keys(self, base: int) -> GenerationKeys:
        return GenerationKeys(self.name, Layout(self.num_shards, base))

    def to_json(self) -> str:
        """The record's JSON; without a retrieval setting it has no ``retrieval`` key,
        byte for byte what releases before the setting wrote."""
        data = asdict(self)
        data.pop("retrieval")
        if self.retrieval is not None:
            data["retrieval"] = self.retrieval.to_dict()
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, raw: bytes | str) -> Generation:
        """The record of its JSON: one without ``retrieval`` (every record written before
        the setting) reads as None."""
        data = json.loads(raw)
        data["encoder"] = EncoderSpec(**data["encoder"])
        setting = data.pop("retrieval", None)
        return cls(
            **data,
            retrieval=None if setting is None else RetrievalSetting.from_dict(setting),
        )


@dataclass(frozen=True)
class Alias:
    serving: str
    epoch: int
    previous: str | None = None


def generation_number(name: str) -> int:
    if not name.startswith("g") or not name[1:].isdigit():
        raise ValueError(f"{name!r} is not a generation name (g1, g2, ...)")
    return int(name[1:])


def text_of(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def parse_alias(raw: Mapping[Any, Any]) -> Alias | None:
    data = {text_of(k): text_of(v) for k, v in raw.items()}
    if "serving" not in data:
        return None
    return Alias(data["serving"], int(data.get("epoch", "1")), data.get("previous") or None)


async def read_alias(client: Any) -> Alias | None:
    """The alias, on an async client (the gateway's); None before a first generation."""
    return parse_alias(await client.hgetall(ALIAS_KEY))


async def read_generation(client: Any, name: str) -> Generation:
    raw = await client.hget(GENERATIONS_KEY, name)
    if raw is None:
        raise NotFound(f"generation {name!r} does not exist")
    return Generation.from_json(raw)


async def read_addresses(client: Any, name: str) -> str | None:
    raw = await client.hget(ADDRESSES_KEY, name)
    return None if raw is None else text_of(raw)


def get_generation(client: Any, name: str) -> Generation:
    """Generation ``name``'s record (blocking client); NotFound when there is none."""
    raw = client.hget(GENERATIONS_KEY, name)
    if raw is None:
        raise NotFound(f"generation {name!r} does not exist")
    return Generation.from_json(raw)


def ensure_first(client: Any, num_shards: int, encoder: EncoderSpec, index_dir: str) -> Generation:
    """Generation g1, serving, for a store that has none yet (idempotent: whoever comes
    first records it; a store written before generations existed becomes g1). Here, not
    in the registry, because the first shard or gateway of a new store records it."""
    first = Generation(
        FIRST_GENERATION,
        "serving",
        num_shards,
        encoder,
        index_dir,
        created_at=time.time(),
        serving_since=time.time(),
    )
    pipe = client.pipeline(transaction=True)
    pipe.hsetnx(GENERATIONS_KEY, first.name, first.to_json())
    pipe.hsetnx(ALIAS_KEY, "serving", first.name)
    pipe.hsetnx(ALIAS_KEY, "epoch", "1")
    pipe.execute()
    # The counter is only ever raised: max(next, 1).
    client.eval(
        "local n = tonumber(redis.call('GET', KEYS[1]) or '0') "
        "if n < 1 then redis.call('SET', KEYS[1], 1) end return 1",
        1,
        NEXT_GENERATION_KEY,
    )
    return get_generation(client, first.name)
