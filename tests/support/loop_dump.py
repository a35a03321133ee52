"""What a test's event loop in a background thread still runs, when closing it hangs:
each unfinished task with its await chain to the innermost frame (``Task.get_stack``
gives only a suspended coroutine's own frame, not what it awaits), or every thread's
stack when the loop does not turn at all (a blocking call on it)."""

from __future__ import annotations

import asyncio
import sys
import traceback
from typing import Any


def await_chain(coro: Any) -> str:
    """``coro``'s frames down its ``cr_await`` chain, outermost first."""
    out = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            out.append(f"{frame.f_code.co_name} ({frame.f_code.co_filename}:{frame.f_lineno})")
        else:
            out.append(repr(coro)[:120])
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return " > ".join(out)


def pending(loop: asyncio.AbstractEventLoop, timeout: float = 10.0) -> str:
    """The unfinished tasks of ``loop`` (running in another thread) and where each
    waits; every thread's stack when the loop does not answer within ``timeout``."""

    async def tasks() -> list[str]:
        me = asyncio.current_task()
        return [
            f"{task.get_name()}: {await_chain(task.get_coro())}"
            for task in asyncio.all_tasks()
            if task is not me
        ]

    try:
        found = asyncio.run_coroutine_threadsafe(tasks(), loop).result(timeout)
    except TimeoutError:
        return "the loop does not turn (a call blocks it); threads:\n" + threads()
    return "\n".join(found) or "no task left"


def threads() -> str:
    """Every thread's stack, innermost frame last."""
    return "\n".join(
        f"thread {ident}:\n" + "".join(traceback.format_stack(frame, limit=12))
        for ident, frame in sys._current_frames().items()
    )
