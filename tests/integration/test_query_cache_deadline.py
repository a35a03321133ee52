"""A lookup cut short by the request's own deadline does not bypass the cache for
others; one that outlives the cache's own timeout does.

A real redis-server, hung for real (SIGSTOP: its socket accepts, nothing answers), as a
cache's Redis hangs in production; the cache's connection is made before the hang. The
bypass is seen from outside: after SIGCONT, a stored entry is found again (not bypassed)
or not (bypassed), and the lookups are counted under those results.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from services.gateway.metrics import QueryCacheMetrics
from services.gateway.query_cache import QueryEmbeddingCache
from tests.support.processes import RedisServer, redis_binary, run_redis

VECTOR = np.array([0.5, 0.5, 0.5, 0.5], dtype=np.float32)


@pytest.fixture(scope="module")
def hung_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server of this module's own (the tests stop and continue it)."""
    if redis_binary() is None:
        pytest.fail("redis-server is not installed (scripts/bootstrap.sh installs it)")
    with run_redis(tmp_path_factory.mktemp("cache-redis")) as server:
        yield server


@contextmanager
def stopped(server: RedisServer) -> Iterator[None]:
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.process.pid, signal.SIGCONT)


def _counted(registry: CollectorRegistry, result: str) -> float:
    value = registry.get_sample_value("gateway_query_cache_lookups_total", {"result": result})
    return value or 0.0


async def _cache_with_an_entry(
    url: str,
) -> tuple[QueryEmbeddingCache, list[str], CollectorRegistry]:
    """A cache (500 ms timeout, bypassed 60 s after a failure) holding one entry, found
    once (so its connection is open before Redis hangs). The timeout leaves a lookup
    that must answer room on a slow machine; a SIGSTOPped Redis outlasts it."""
    registry = CollectorRegistry()
    cache = QueryEmbeddingCache(
        url,
        model="m",
        size="base",
        dim=4,
        ttl_s=60,
        max_entries=10,
        timeout_s=0.5,
        backoff_s=60.0,
        metrics=QueryCacheMetrics.create(registry),
    )
    keys = cache.keys([f"q-{os.urandom(4).hex()}"], "query")
    cache.store(keys, VECTOR[None, :], [False])
    await cache.drain()
    found = await cache.lookup(keys, timeout=5.0)
    assert found[0] is not None and np.allclose(found[0].vector, VECTOR)
    return cache, keys, registry


def test_a_lookup_cut_by_the_requests_deadline_does_not_bypass_the_cache(
    hung_redis: RedisServer,
) -> None:
    async def run() -> None:
        cache, keys, registry = await _cache_with_an_entry(hung_redis.url)
        try:
            with stopped(hung_redis):
                # deadlines shorter than the cache's own 500 ms timeout: cut by them
                assert await cache.lookup(keys, timeout=0.0) == [None]
                assert await cache.lookup(keys, timeout=0.1) == [None]
            assert _counted(registry, "error") == 2
            found = await cache.lookup(keys, timeout=5.0)  # Redis answers again: used
            assert found[0] is not None and _counted(registry, "bypassed") == 0
        finally:
            await cache.close()

    asyncio.run(run())


def test_a_lookup_slower_than_the_cache_timeout_bypasses_it(hung_redis: RedisServer) -> None:
    async def run() -> None:
        cache, keys, registry = await _cache_with_an_entry(hung_redis.url)
        try:
            with stopped(hung_redis):
                # the request had time to spare: Redis is what is slow
                assert await cache.lookup(keys, timeout=5.0) == [None]
            assert _counted(registry, "error") == 1
            # Redis answers again, but the cache is bypassed for backoff_s (60 s)
            assert await cache.lookup(keys, timeout=5.0) == [None]
            assert _counted(registry, "bypassed") == 1
        finally:
            await cache.close()

    asyncio.run(run())
