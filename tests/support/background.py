"""A test stack that lives for a whole test module: its servers run on an event loop in
a thread of their own, and the tests drive it with blocking gRPC clients (as a client
process would), so that one stack serves every test of the module, including
``hypothesis`` tests, which cannot be coroutines."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest

from tests.support import loop_dump
from tests.support.processes import RedisServer, run_redis
from tests.support.rerank import rerank_in_background
from tests.support.shards import scifact_vectors, shared_test_index
from tests.support.stack import TestStack, running_stack

T = TypeVar("T")


@dataclass
class BackgroundStack:
    stack: TestStack
    loop: asyncio.AbstractEventLoop

    @property
    def address(self) -> str:
        return self.stack.address

    def run(self, step: Awaitable[T], timeout: float = 60.0) -> T:
        """Run ``step`` on the stack's loop (e.g. to read its objects) and wait for it."""

        async def wrapped() -> T:
            return await step

        return asyncio.run_coroutine_threadsafe(wrapped(), self.loop).result(timeout)


@contextmanager
def stack_in_background(
    redis_url: str,
    index_dir: Path,
    tmp: Path,
    *,
    shards: int = 2,
    triton_url: str | None = None,
    gateway_settings: dict[str, object] | None = None,
    start_timeout: float = 300.0,
) -> Iterator[BackgroundStack]:
    """:func:`tests.support.stack.running_stack` on a loop in a background thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-stack", daemon=True)
    thread.start()
    context = running_stack(
        redis_url,
        index_dir,
        tmp,
        shards=shards,
        triton_url=triton_url,
        gateway_settings=gateway_settings,
    )
    try:
        stack = asyncio.run_coroutine_threadsafe(context.__aenter__(), loop).result(start_timeout)
        try:
            yield BackgroundStack(stack, loop)
        finally:
            closing = asyncio.run_coroutine_threadsafe(context.__aexit__(None, None, None), loop)
            try:
                closing.result(120)
            except TimeoutError:
                raise AssertionError(
                    f"the stack did not close in 120 s; its loop runs:\n{loop_dump.pending(loop)}"
                ) from None
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


@contextmanager
def stack_with_rerank(
    index_dir: Path, tmp: Path, gateway_settings: dict[str, object] | None = None
) -> Iterator[tuple[BackgroundStack, RedisServer]]:
    """A real rerank server (tiny checkpoint), a real redis-server and the stack in the
    background with its gateway reranking on that server; the stack and its Redis."""
    with (
        rerank_in_background(tmp) as reranker,
        run_redis(tmp / "redis") as store,
        stack_in_background(
            store.url,
            index_dir,
            tmp,
            gateway_settings={
                "rerank_url": f"127.0.0.1:{reranker.port}",
                **(gateway_settings or {}),
            },
        ) as bg,
    ):
        yield bg, store


@contextmanager
def scifact_stack_with_rerank(
    tmp_path_factory: pytest.TempPathFactory,
    scifact_dir: Path,
    name: str,
    gateway_settings: dict[str, object] | None = None,
) -> Iterator[tuple[BackgroundStack, RedisServer, int]]:
    """:func:`stack_with_rerank` on the session's shared SciFact test index, in a new
    temporary folder named after ``name``: the stack, its Redis and the index's nlist
    (an nprobe that probes every list)."""
    from services.index.core.trained import Manifest

    index_dir = shared_test_index(tmp_path_factory.getbasetemp(), scifact_vectors(scifact_dir))
    tmp = tmp_path_factory.mktemp(name)
    with stack_with_rerank(index_dir, tmp, gateway_settings) as (bg, store):
        yield bg, store, Manifest.read(index_dir).nlist
