"""services/common/timeouts.py: ``wait_for`` that never loses a cancellation."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from services.common import timeouts


def cancelled_as_the_result_arrives(wait_for: Callable[[Awaitable[Any], float], Any]) -> bool:
    """Whether a task waiting in ``wait_for`` ends cancelled when its cancel comes in the
    instant its result does (Redis's client answering as a gRPC call is cancelled)."""

    async def scenario() -> bool:
        result: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        waiting = asyncio.ensure_future(wait_for(result, 10.0))
        await asyncio.sleep(0)  # the task now waits for the result
        result.set_result(1)
        waiting.cancel()
        try:
            await waiting
        except asyncio.CancelledError:
            return True
        return False

    return asyncio.run(scenario())


def test_a_cancel_that_comes_with_the_result_is_kept() -> None:
    """Python 3.11's asyncio.wait_for returns the result here and the cancel is lost
    (the gateway's refresh loop then never ended and its close hung)."""
    assert cancelled_as_the_result_arrives(timeouts.wait_for)


def test_the_timeout_raises_timeout_error_and_cancels_the_awaitable() -> None:
    async def scenario() -> None:
        never: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        with pytest.raises(TimeoutError):
            await timeouts.wait_for(never, 0.01)
        assert never.cancelled()
        assert await timeouts.wait_for(asyncio.sleep(0, "x"), None) == "x"

    asyncio.run(scenario())
