"""The tails of the shards' change logs: the newest position of each (what a STRONG search
waits for the shards to have applied). Read through the shared
:class:`~services.index.client.connection.StoreConnection`; the logs' keys and entry
format are :mod:`services.index.changelog`'s."""

from __future__ import annotations

from typing import Any

from services.common.domain import WriteToken
from services.index.changelog import text
from services.index.client.connection import StoreConnection
from services.index.keys import GenerationKeys


class LogTailReader:
    """Reads the log tails (the gateway's :class:`~services.gateway.ports.LogTails`) of
    generation ``keys`` (default: the connection's, g1 of the base layout)."""

    def __init__(self, connection: StoreConnection, keys: GenerationKeys | None = None) -> None:
        self.connection = connection
        self.keys = keys if keys is not None else connection.generation_keys()

    async def tail(self) -> WriteToken:
        """The newest position of every shard's log, in one pipelined round trip; a shard
        whose log is empty is left out."""
        shards = range(self.keys.num_shards)

        async def read() -> list[Any]:
            async with self.connection.redis.pipeline(transaction=False) as pipe:
                for shard in shards:
                    pipe.xrevrange(self.keys.log(shard), count=1)
                return list(await pipe.execute())

        replies = await self.connection.read(read)
        return {s: text(r[0][0]) for s, r in zip(shards, replies, strict=True) if r}
