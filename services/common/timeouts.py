"""``wait_for`` that keeps a cancellation: Python 3.11's :func:`asyncio.wait_for` returns
the awaited result when the task is cancelled in the instant that result arrives, and
the cancellation is lost (bpo-42130, fixed by 3.12's rewrite of ``wait_for`` over
:func:`asyncio.timeout`). A background loop whose cancel is lost that way never ends, and
whatever awaits it (a server's shutdown) waits forever. :func:`wait_for` is the 3.12
behaviour on 3.11: the awaitable runs inside :func:`asyncio.timeout`, which tells its
own expiry from a cancellation that came from outside."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def wait_for(awaitable: Awaitable[T], timeout: float | None) -> T:
    """``await awaitable``; TimeoutError once ``timeout`` seconds (None: no bound) have
    passed, with the awaitable cancelled; a cancellation of the caller always raises."""
    async with asyncio.timeout(timeout):
        return await awaitable
