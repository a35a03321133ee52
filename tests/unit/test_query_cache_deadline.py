"""A lookup cut short by the request's own deadline does not bypass the cache for others;
one that outlives the cache's own timeout does."""

from __future__ import annotations

import asyncio
from typing import Any

from services.gateway.query_cache import QueryEmbeddingCache


def _cache() -> QueryEmbeddingCache:
    cache = QueryEmbeddingCache(
        "redis://127.0.0.1:1/0", model="m", size="base", dim=4, ttl_s=60, max_entries=10,
        timeout_s=0.05, backoff_s=60.0,
    )  # fmt: skip

    async def hung(**_: Any) -> list[bytes | None]:
        await asyncio.sleep(10)
        return []

    cache._lookup = hung
    return cache


def test_a_lookup_cut_by_the_requests_deadline_does_not_bypass_the_cache() -> None:
    async def run() -> None:
        cache = _cache()
        assert await cache.lookup(cache.keys(["q"], "query"), timeout=0.0) == [None]
        assert cache._bypass_until == 0.0
        assert await cache.lookup(cache.keys(["q"], "query"), timeout=0.001) == [None]
        assert cache._bypass_until == 0.0
        await cache.close()

    asyncio.run(run())


def test_a_lookup_slower_than_the_cache_timeout_bypasses_it() -> None:
    async def run() -> None:
        cache = _cache()
        assert await cache.lookup(cache.keys(["q"], "query"), timeout=5.0) == [None]
        assert cache._bypass_until > 0.0
        await cache.close()

    asyncio.run(run())
