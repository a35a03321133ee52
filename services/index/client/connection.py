"""The one connection the gateway's store clients share: one Redis or a Redis Cluster.

:class:`StoreConnection` holds the client (:mod:`services.process.redis_client`), the key
layout of the documents and logs (:class:`~services.index.keys.DocKeys`), the bound on
concurrent commands and the retry of idempotent reads. The change-log writer
(:mod:`services.index.client.writer`), the document reader
(:mod:`services.index.client.documents`) and the log-tail reader
(:mod:`services.index.client.tails`) all go through one, so they share one pool.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import redis
from redis.exceptions import RedisClusterException

from services.common.errors import Unavailable
from services.index.keys import FIRST_GENERATION, DocKeys, GenerationKeys, Layout
from services.process.redis_client import TRANSIENT, Gate, async_client, is_cluster

# Everything a Redis client raises (RedisClusterException is no RedisError).
REDIS_ERRORS: tuple[type[Exception], ...] = (redis.RedisError, RedisClusterException)


class StoreConnection:
    """The document store's and change logs' Redis, as the gateway reaches it.

    ``redis_url`` names one Redis or a Redis Cluster (:mod:`services.process.redis_client`);
    ``num_shards`` is the shard count of the clients' default layout (the shard of a
    document is ``shard_of(id, num_shards)``, and its keys carry it,
    :mod:`services.index.keys`); a client of another generation or layout is given its
    :class:`~services.index.keys.GenerationKeys` / :class:`~services.index.keys.Layout`.
    ``max_connections`` bounds the pool (one Redis: a blocking pool that waits up to
    ``pool_timeout_s``; a cluster's pools fail at once when full, so :meth:`slot` bounds
    the concurrency instead). ``read_retry_s``: how long :meth:`read` retries a read while
    Redis cannot be reached.
    """

    def __init__(
        self,
        redis_url: str,
        num_shards: int,
        *,
        max_connections: int = 64,
        pool_timeout_s: float = 5.0,
        read_retry_s: float = 3.0,
    ) -> None:
        if num_shards < 1:
            raise ValueError("num_shards must be positive")
        self.num_shards = num_shards
        self.keys = DocKeys(num_shards)
        self.read_retry_s = read_retry_s
        self.redis: Any = async_client(
            redis_url, max_connections=max_connections, pool_timeout_s=pool_timeout_s
        )
        self.cluster = is_cluster(self.redis)
        self._gate = Gate(max_connections, pool_timeout_s) if self.cluster else None

    def layout(self) -> Layout:
        """The default layout of the clients on this connection: ``num_shards`` shards, the
        store's base layout (a client of another generation's layout names its own)."""
        return Layout(self.num_shards, self.num_shards)

    def generation_keys(self) -> GenerationKeys:
        """The default generation of the clients on this connection: g1 of :meth:`layout`
        (the store as it was before generations, docs/generations.md)."""
        return GenerationKeys(FIRST_GENERATION, self.layout())

    def slot(self) -> AbstractAsyncContextManager[None]:
        """Hold one of the ``max_connections`` slots (a cluster; one Redis: the pool does)."""
        return self._gate.slot() if self._gate is not None else _no_gate()

    async def read(self, read: Callable[[], Awaitable[list[Any]]]) -> list[Any]:
        """Run an idempotent read; while Redis cannot be reached (a restart takes about a
        second, a cluster failover a few), try again with backoff for up to
        ``read_retry_s``, then Unavailable. The caller's deadline bounds it too (it
        cancels the wait)."""
        give_up = time.monotonic() + self.read_retry_s
        pause = 0.05
        while True:
            try:
                async with self.slot():
                    return await read()
            except TRANSIENT as exc:
                if time.monotonic() + pause > give_up:
                    raise Unavailable(f"redis: {exc}") from exc
                await asyncio.sleep(pause)
                pause = min(2 * pause, 0.5)
            except REDIS_ERRORS as exc:
                raise Unavailable(f"redis: {exc}") from exc

    async def close(self) -> None:
        await self.redis.aclose()


@asynccontextmanager
async def _no_gate() -> AsyncIterator[None]:
    yield
