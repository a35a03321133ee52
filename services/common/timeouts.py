"""``wait_for`` that keeps a cancellation: Python 3.11's :func:`asyncio.wait_for` returns
the awaited result when the task is cancelled in the instant that result arrives, and
the cancellation is lost (bpo-42130, fixed by 3.12's rewrite of ``wait_for`` over
:func:`asyncio.timeout`). A background loop whose cancel is lost that way never ends, and
whatever awaits it (a server's shutdown) waits forever. :func:`wait_for` is the 3.12
behaviour on 3.11: the awaitable runs inside :func:`asyncio.timeout`, which tells its
own expiry from a cancellation that came from outside.

:func:`cancel_and_wait` ends a background task whose cancel code not ours may lose (the
same bug, inside redis-py), by sending it again until the task has ended."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")


async def wait_for(awaitable: Awaitable[T], timeout: float | None) -> T:
    """``await awaitable``; TimeoutError once ``timeout`` seconds (None: no bound) have
    passed, with the awaitable cancelled; a cancellation of the caller always raises."""
    async with asyncio.timeout(timeout):
        return await awaitable


# How often :func:`cancel_and_wait` sends a cancel again to a task that has not ended.
RESEND_S = 0.05


async def cancel_and_wait(*tasks: asyncio.Future[Any] | None, resend_s: float = RESEND_S) -> None:
    """Cancel ``tasks`` (None ones skipped) and wait until each has ended, sending the
    cancel again every ``resend_s`` to one that has not: a cancel can be lost in code
    that is not ours (redis-py sends each command under 3.11's ``asyncio.wait_for``), and
    a background loop that lost it never ends, so a close that awaits it waits forever
    (a server's health watcher: the likely cause of two test gateways' closes that hung
    in CI, docs/architecture.md). Each task's outcome is
    retrieved (an error in it is not reported here); a cancellation of the caller raises.
    For loops and waits without cleanup: a task still cleaning up after the first cancel
    gets the next one too."""
    pending = {task for task in tasks if task is not None}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=resend_s)
    for ended in tasks:
        if ended is not None and not ended.cancelled():
            ended.exception()
