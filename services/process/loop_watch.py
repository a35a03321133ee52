"""A late event loop, seen and named (``--loop-watch-ms``; every asyncio server of ours).

Every request a server handles waits for its one event loop: code that holds the loop
(a synchronous call, a long computation, a lock) or a loop thread that waits for a CPU
delays every request in flight, and no request's own timings show it. A search at a
generation switch took 112 ms of which its handler took 13 (docs/generations.md "The
switch's slow search, placed"): the rest passed before the handler began.

:class:`LoopWatch` puts a heartbeat on the loop (a timer every ``beat_s``) and a thread
beside it that wakes as often. When the next beat is more than ``threshold_s`` late, the
thread logs a WARNING once for that beat with the loop thread's Python stack at that
moment and how much CPU the loop thread used since the watch's previous wake (the
thread's own CPU clock, ``pthread_getcpuclockid``): about all of that time when code
held the loop (the stack names it), little when the thread waited for a CPU or in a
system call. The heartbeat records how late each beat came
(:attr:`LoopWatch.latest_s`, :attr:`LoopWatch.longest_s`, :attr:`LoopWatch.blocks`).

Off by default: the heartbeat and the thread add two wake-ups per ``beat_s``
(``threshold_s`` / 2), which on a mostly idle machine are not free (docs/performance.md,
"Where a quiet search's time goes").
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable

log = logging.getLogger(__name__)


def _report(late_s: float, cpu_s: float | None, over_s: float, stack: str) -> None:
    used = (
        f"; its thread ran {cpu_s * 1e3:.0f} ms of CPU in the last {over_s * 1e3:.0f} ms"
        if cpu_s is not None
        else ""
    )
    log.warning("event loop late by %.0f ms%s; it is at:\n%s", late_s * 1e3, used, stack)


class LoopWatch:
    """See the module. :meth:`start` in the loop's thread, :meth:`stop` when done."""

    def __init__(
        self,
        threshold_s: float,
        *,
        beat_s: float | None = None,
        report: Callable[[float, float | None, float, str], None] = _report,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if threshold_s <= 0:
            raise ValueError("threshold_s must be positive")
        self.threshold_s = threshold_s
        self.beat_s = beat_s if beat_s is not None else threshold_s / 2
        self._report = report
        self._clock = clock
        self._due = clock()  # when the next beat should come
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._thread: threading.Thread | None = None
        self._loop_thread = 0  # threading ident of the loop's thread
        self._cpu_clock: int | None = None  # its CPU-time clock (None: not offered here)
        self.latest_s = 0.0  # how late the last beat came
        self.longest_s = 0.0
        self.blocks = 0  # beats reported late

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._loop_thread = threading.get_ident()
        try:
            self._cpu_clock = time.pthread_getcpuclockid(self._loop_thread)
        except (AttributeError, OSError):  # not on this platform
            self._cpu_clock = None
        self._due = self._clock() + self.beat_s
        self._handle = loop.call_later(self.beat_s, self._beat)
        self._thread = threading.Thread(target=self._watch, name="loop-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._handle is not None:
            self._handle.cancel()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _beat(self) -> None:
        now = self._clock()
        self.latest_s = max(0.0, now - self._due)
        self.longest_s = max(self.longest_s, self.latest_s)
        self._due = now + self.beat_s
        assert self._loop is not None
        self._handle = self._loop.call_later(self.beat_s, self._beat)

    def _loop_cpu_s(self) -> float | None:
        """CPU seconds the loop's thread has used (None where its clock is not offered)."""
        if self._cpu_clock is None:
            return None
        try:
            return time.clock_gettime(self._cpu_clock)
        except OSError:  # the thread is gone
            return None

    def _watch(self) -> None:
        reported = None  # the beat reported late already (one report per beat)
        # (when, the loop thread's CPU) at the watch's previous wake: a report's CPU is
        # counted from there, so it covers the last ``beat_s`` or so of the wait
        last = (self._clock(), self._loop_cpu_s())
        while not self._stop.wait(self.beat_s):
            now, cpu = self._clock(), self._loop_cpu_s()
            since, last = last, (now, cpu)
            late = now - self._due
            if late <= self.threshold_s or reported == self._due:
                continue
            reported = self._due
            frame = sys._current_frames().get(self._loop_thread)
            stack = "".join(traceback.format_stack(frame)) if frame is not None else "(gone)\n"
            used = cpu - since[1] if cpu is not None and since[1] is not None else None
            self.blocks += 1
            self._report(late, used, now - since[0], stack)
