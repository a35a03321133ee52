"""The event loop a server process runs on: uvloop by default, the standard library's on
request (``--event-loop asyncio``).

Measured (``python -m bench.hop_costs``, docs/performance.md "uvloop"): one grpc.aio
round trip of a shard's request and answer costs 0.67 times the CPU and 0.70 times the
wall time on uvloop (both sides) of what it costs on the standard library's loop. grpc.aio,
redis.asyncio and aiohttp run on either; nothing of ours depends on which.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Literal, TypeVar

from services.process.loop_watch import LoopWatch

T = TypeVar("T")

EventLoop = Literal["uvloop", "asyncio"]
LOOPS: tuple[EventLoop, ...] = ("uvloop", "asyncio")


def loop_factory(name: EventLoop) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """What makes a loop of ``name``; None: the standard library's default."""
    if name == "asyncio":
        return None
    import uvloop  # imported here: the CLI's other commands do not load it

    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T], name: EventLoop = "uvloop", watch_ms: float = 0) -> T:
    """``asyncio.run(main)`` on a loop of ``name``; ``watch_ms`` > 0: with a
    :class:`~services.process.loop_watch.LoopWatch` that logs the loop's stack whenever
    the loop is that late (``--loop-watch-ms``)."""
    with asyncio.Runner(loop_factory=loop_factory(name)) as runner:
        return runner.run(_watched(main, watch_ms) if watch_ms > 0 else main)


async def _watched(main: Coroutine[Any, Any, T], watch_ms: float) -> T:
    watch = LoopWatch(watch_ms / 1e3)
    watch.start(asyncio.get_running_loop())
    try:
        return await main
    finally:
        watch.stop()
