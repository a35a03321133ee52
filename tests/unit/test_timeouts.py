"""services/common/timeouts.py: ``wait_for`` that never loses a cancellation."""

from __future__ import annotations

import asyncio
import sys
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


class _Loop:
    """A background loop whose every turn waits in 3.11's own ``asyncio.wait_for``, as
    redis-py's command sends do: :meth:`answer` completes the turn's wait (the next turn
    begins at once), so a cancel sent in that instant is lost on Python 3.11."""

    def __init__(self) -> None:
        self.turns: list[asyncio.Future[int]] = []
        self.waiting = asyncio.Event()

    async def run(self) -> None:
        while True:
            turn: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            self.turns.append(turn)
            self.waiting.set()
            await asyncio.wait_for(turn, 10.0)  # the stdlib's, on purpose

    async def answer(self) -> None:
        await self.waiting.wait()
        self.waiting.clear()
        self.turns[-1].set_result(1)


def test_cancel_and_wait_ends_a_loop_whose_first_cancel_is_lost() -> None:
    async def scenario() -> None:
        loop = _Loop()
        task = asyncio.ensure_future(loop.run())
        await loop.answer()
        task.cancel()  # in the instant the turn's answer came: lost on 3.11
        await loop.waiting.wait()  # ... the loop took its next turn
        lost = not task.done()
        await timeouts.wait_for(timeouts.cancel_and_wait(task), 5.0)
        assert task.cancelled()
        if sys.version_info < (3, 12):
            assert lost, "the scenario did not lose the cancel: it proves nothing here"

    asyncio.run(scenario())


def test_cancel_and_wait_skips_none_and_keeps_a_tasks_error_retrieved() -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    async def scenario() -> None:
        task = asyncio.ensure_future(fails())
        await asyncio.sleep(0)  # it has ended with its error
        await timeouts.cancel_and_wait(None, task)
        assert isinstance(task.exception(), RuntimeError)

    asyncio.run(scenario())
