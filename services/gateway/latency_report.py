"""The gateway's report of its searches' latency, every second, into Redis: a rollout's
builder paces its re-embedding on it (the format and the reading:
:mod:`services.generations.serving_latency`; the pacing: :mod:`services.generations.pacing`).

Each search's total time goes into a :class:`~services.generations.serving_latency.LatencyWindow`
(an append, no I/O on the request's path); a task of its own writes the window's summary
under this gateway's field of ``{gtr}:search-latency``. A Redis that cannot be written is
logged once while it lasts and costs nothing else: the builder then paces on the other
gateways' reports, or not at all."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from typing import Any

from services.generations import serving_latency
from services.generations.serving_latency import LatencyWindow

log = logging.getLogger(__name__)


def reporter_id(port: int) -> str:
    """This gateway's field: host, port and process (unique on a host, stable in a run)."""
    return f"{socket.gethostname()}:{port}:{os.getpid()}"


class LatencyReporter:
    """Writes ``window``'s summary as ``reporter`` every ``interval_s`` until :meth:`close`."""

    def __init__(
        self,
        client: Any,
        window: LatencyWindow,
        reporter: str,
        interval_s: float = serving_latency.PUBLISH_S,
    ) -> None:
        self.client = client
        self.window = window
        self.reporter = reporter
        self.interval_s = interval_s
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._failing = ""

    @classmethod
    def started(cls, client: Any, window: LatencyWindow, reporter: str) -> LatencyReporter:
        """A reporter of ``window``, running."""
        running = cls(client, window, reporter)
        running.start()
        return running

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        self._stopping.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def report_once(self) -> None:
        """Write the summary now (a failure is logged, once while it repeats)."""
        try:
            await serving_latency.publish(self.client, self.reporter, self.window.summary())
        except Exception as exc:
            message = f"{type(exc).__name__}: {exc}"
            if message != self._failing:
                log.warning("reporting the searches' latency to Redis failed: %s", message)
            self._failing = message
        else:
            self._failing = ""

    async def _run(self) -> None:
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval_s):
                    await self._stopping.wait()
            if not self._stopping.is_set():
                await self.report_once()
