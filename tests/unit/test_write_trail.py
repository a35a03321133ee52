"""services.gateway.write_trail: a slow or unanswered write logs where its time went."""

from __future__ import annotations

import asyncio
import logging

import pytest

from services.gateway import write_trail
from services.gateway.write_trail import step, trail

LOGGER = write_trail.__name__


def test_a_slow_write_logs_each_step_with_its_time(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(write_trail, "SLOW_WRITE_S", 0.0)  # every write counts as slow
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with trail("upsert of 1"):
        with step("attempt on g1"):
            pass
        with step("alias re-read"):
            pass
    (record,) = caplog.records
    message = record.getMessage()
    assert message.startswith("slow write: upsert of 1 ended ok after"), message
    assert "attempt on g1 at " in message and "alias re-read at " in message, message
    assert message.index("attempt on g1") < message.index("alias re-read"), message


def test_a_fast_write_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with trail("delete of 2"), step("store"):
        pass
    assert caplog.records == []


def test_a_write_cancelled_by_its_callers_deadline_logs_the_step_it_waited_in(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """However quick: a write that ends without an answer says where it was."""
    caplog.set_level(logging.WARNING, logger=LOGGER)

    async def handler() -> None:
        with trail("upsert of 1"):
            with step("encode own"):
                pass
            with step("alias re-read"):
                await asyncio.Event().wait()  # never set: the caller gives up

    async def caller() -> None:
        task = asyncio.ensure_future(handler())
        await asyncio.sleep(0)  # the handler reaches its wait
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(caller())
    (record,) = caplog.records
    message = record.getMessage()
    assert "ended cancelled" in message, message
    assert "encode own at" in message and "ms done" in message, message
    assert "alias re-read at" in message and message.endswith("ms cancelled"), message


def test_steps_outside_a_write_are_ignored(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with step("encode own"):
        pass
    assert caplog.records == []


def test_a_write_that_loops_keeps_its_first_and_last_steps(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(write_trail, "SLOW_WRITE_S", 0.0)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    total = write_trail._HEAD_STEPS + write_trail._TAIL_STEPS + 5
    with trail("upsert of 1"):
        for n in range(total):
            with step(f"pause {n}"):
                pass
    message = caplog.records[0].getMessage()
    assert "pause 0 at" in message and f"pause {total - 1} at" in message, message
    assert "... 5 steps ..." in message, message
    assert f"pause {write_trail._HEAD_STEPS} at" not in message, message
