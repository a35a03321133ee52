"""One index generation's parts as the gateway holds them (:class:`Bundle`), the alias as
it knows it (:class:`Serving`), and what :class:`~services.gateway.generations.GenerationSource`
reads and reports through (:class:`AliasReader`, :class:`SourceEvents`); the policy of
when the alias is read and a generation is built lives in
:mod:`services.gateway.generations` (docs/generations.md)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from services.common.domain import TokenOrigin, WriteToken
from services.common.errors import Unavailable
from services.common.retrieval_setting import RetrievalSetting
from services.gateway.ports import (
    DocumentStore,
    DocumentWriter,
    Encoder,
    IndexQuery,
    LogTails,
    VectorIndex,
)
from services.generations import tokens
from services.generations.registry import Alias, Generation, read_alias, read_generation
from services.index.client.connection import REDIS_ERRORS
from services.index.keys import ROLLOUT_KEY

log = logging.getLogger(__name__)

WARM_QUERY = "warm up"


async def warm(bundle: Bundle, timeout_s: float) -> bool:
    """One query through a generation's encoder and shards before it serves: connects the
    gateway's channels to its shards and Triton version and runs their first calls, which
    cost tens of milliseconds more than later ones (``bench.rollout`` saw the searches at a
    switch go from ~45 to ~175 ms p99 without it). Bounded by ``timeout_s``; a failure is
    logged, never raised: the generation serves anyway, as it would have unwarmed."""
    try:
        async with asyncio.timeout(timeout_s):
            embedded = await bundle.encoder.encode([WARM_QUERY], "query", timeout=timeout_s)
            await bundle.index.search(IndexQuery(embedded.vectors, 1), timeout_s)
        return True
    except Exception as exc:
        log.info("warming generation %s failed (it serves unwarmed): %s", bundle.name, exc)
        return False


def encoder_identity(encoder: Encoder) -> str:
    """What decides a query's embedding besides its text: the model, and the Triton
    version and digest when the encoder has them (the query cache keys on this, so two
    generations of one encoder share their cached embeddings and two encoders never do)."""
    version = int(getattr(encoder, "model_version", 0) or 0)
    digest = str(getattr(encoder, "digest", "") or "")
    ident = encoder.model_name
    if version:
        ident += f"@{version}"
    if digest:
        ident += f"#{digest}"
    return ident


@dataclass(eq=False)
class Bundle:
    """One generation's parts, as a request uses them. ``owned``: what closing the
    bundle closes (an encoder shared with other generations is not in it)."""

    name: str
    encoder: Encoder
    index: VectorIndex
    documents: DocumentStore
    tails: LogTails
    writer: DocumentWriter
    owned: Sequence[Any] = ()
    users: int = 0
    retired: bool = False
    closed: bool = False
    encoder_id: str = ""
    # set once its warm-up ended (or it needed none): a switch to it waits for no more
    warmed: asyncio.Event = field(default_factory=asyncio.Event)
    warming: bool = False  # its warm-up has begun

    def __post_init__(self) -> None:
        if not self.encoder_id:
            self.encoder_id = encoder_identity(self.encoder)

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for part in reversed(list(self.owned)):
            close = getattr(part, "close", None)
            if close is None:
                continue
            try:
                result = close()
                if asyncio.iscoroutine(result):
                    await result
            except Exception:  # one part failing to close must not keep the others open
                log.exception("closing %r of generation %s", part, self.name)


@dataclass(frozen=True)
class Serving:
    """The alias as this gateway knows it, with the serving generation's parts."""

    generation: str
    epoch: int
    bundle: Bundle
    # the serving generation's log positions at its switch-in, by shard (docs/generations.md)
    switch_in: WriteToken = field(default_factory=dict)
    previous: str | None = None
    # the serving generation's retrieval setting (its record's; None: the gateway's flags)
    setting: RetrievalSetting | None = None

    @property
    def origin(self) -> TokenOrigin:
        """What a write acknowledged now carries in its token."""
        return TokenOrigin(self.generation, self.epoch)


def resolve_token(token: WriteToken, origin: TokenOrigin, serving: Serving) -> WriteToken:
    """The positions in ``serving``'s logs that a SESSION search with ``token`` (taken in
    ``origin``) must wait for: :func:`services.generations.tokens.resolve_token` (the rule)
    with this gateway's cached alias."""
    return tokens.resolve_token(
        token,
        origin,
        generation=serving.generation,
        epoch=serving.epoch,
        switch_in=serving.switch_in,
    )


class AliasReader(Protocol):
    """The registry as the gateway reads it (async; :class:`RedisAliasReader`)."""

    async def alias(self) -> Alias | None: ...

    async def generation(self, name: str) -> Generation: ...

    async def rollout_target(self) -> str | None:
        """The generation a running rollout builds (None: no rollout)."""
        ...


class RedisAliasReader:
    """:class:`AliasReader` over the gateway's async Redis (or Redis Cluster) client; a
    Redis that cannot be reached is Unavailable (a write re-reading the alias then fails
    as its write would, safe to retry)."""

    def __init__(self, client: Any) -> None:
        self.client = client

    async def alias(self) -> Alias | None:
        try:
            return await read_alias(self.client)
        except REDIS_ERRORS as exc:
            raise Unavailable(f"redis: reading the generations alias: {exc}") from exc

    async def generation(self, name: str) -> Generation:
        try:
            return await read_generation(self.client, name)
        except REDIS_ERRORS as exc:
            raise Unavailable(f"redis: reading generation {name}: {exc}") from exc

    async def rollout_target(self) -> str | None:
        try:
            raw = await self.client.hget(ROLLOUT_KEY, "target")
        except REDIS_ERRORS as exc:
            raise Unavailable(f"redis: reading the rollout: {exc}") from exc
        return (raw.decode() if isinstance(raw, bytes) else raw) or None


BundleFactory = Callable[[Generation], Awaitable[Bundle]]


class SourceEvents(Protocol):
    """What the source reports (the gateway's metrics; :class:`NoEvents` by default)."""

    def serving(self, generation: str, epoch: int, model: str) -> None:
        """``generation`` serves at ``epoch``; ``model``: its encoder's model name."""

    def refresh_failed(self) -> None: ...


class NoEvents:
    def serving(self, generation: str, epoch: int, model: str) -> None:
        pass

    def refresh_failed(self) -> None:
        pass
