"""The open-loop sender: every request leaves at its scheduled time, answered or not.

One asyncio event loop, grpc.aio. The sender walks the schedule by absolute time
(``start + offset``, never ``sleep(interval)``, so waits do not add up to drift), starts
each call as a task without waiting for it, and records per request the scheduled time,
the time its call actually started and the time it completed. Latency is measured from
the *scheduled* time: a server that stalls makes every request due during the stall
wait, and that wait is in their latencies (no coordinated omission, unlike a closed-loop
client that simply stops sending while it waits). When the sender itself runs late, the
gap between scheduled and sent time (its lag) says so; the rate is never lowered
silently. Requests beyond ``max_in_flight`` outstanding are not sent and are counted
under ``NOT_SENT_MAX_IN_FLIGHT`` (a bound on memory when the server stops answering).
"""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np

from loadtest.schedule import Process, arrival_offsets
from loadtest.target import Target
from loadtest.workload import Workload, callers, is_partial, rerank_skipped

NOT_SENT = "NOT_SENT_MAX_IN_FLIGHT"
START_LEAD_S = 0.02  # the first request is due this long after the sender starts


@dataclass(frozen=True)
class RunConfig:
    rate: float  # requests per second offered
    duration_s: float  # no request is scheduled at or after this offset
    count: int | None = None  # at most this many requests
    process: Process = "poisson"
    seed: int = 0
    timeout_s: float = 5.0  # gRPC deadline of each request
    max_in_flight: int = 10_000
    channels: int = 1  # HTTP/2 connections, requests spread round-robin
    processes: int = 1  # sender processes (loadtest.processes), each every N-th request


@dataclass
class Records:
    """One entry per scheduled request; times in seconds on the loop's monotonic clock."""

    ops: list[str]
    due: np.ndarray  # scheduled send time
    sent: np.ndarray  # the call started (NaN: never sent)
    done: np.ndarray  # the call completed (NaN: never sent)
    codes: list[str]  # gRPC status code name, or NOT_SENT
    partial: np.ndarray  # bool, an OK search answered without every shard
    rerank_skipped: np.ndarray  # bool, an OK search answered without the rerank it asked for
    start: float  # the run's time zero (offset 0 is due here)
    config: RunConfig
    index: np.ndarray  # each request's position in the whole schedule
    sender: np.ndarray  # the pid of the process that sent it (or would have)

    @property
    def latency_s(self) -> np.ndarray:
        """Completion − scheduled time (what the user of the service waited)."""
        return self.done - self.due

    @property
    def service_s(self) -> np.ndarray:
        """Completion − actual send time (what a closed-loop client would report)."""
        return self.done - self.sent

    @property
    def lag_s(self) -> np.ndarray:
        """Actual − scheduled send time: the generator's own delay."""
        return self.sent - self.due


async def run_open_loop(
    target: Target,
    workload: Workload,
    cfg: RunConfig,
    *,
    share: tuple[int, int] = (0, 1),
    start_at: Callable[[], float] | None = None,
) -> Records:
    """Send ``workload`` to ``target`` on ``cfg``'s schedule; every outcome is recorded.

    ``share=(k, m)`` sends only requests k, k+m, k+2m, ... of the schedule (one of m
    processes, :mod:`loadtest.processes`). ``start_at`` is called (in a thread) once the
    requests are built and every channel is connected, and returns the monotonic time at
    which offset 0 is due (the readiness barrier of those processes: it returns when all
    of them are ready); without it offset 0 is due shortly after the channels connect."""
    offsets = arrival_offsets(
        cfg.rate, cfg.duration_s, cfg.count, process=cfg.process, seed=cfg.seed
    )
    ops, messages = workload.requests(len(offsets), cfg.seed, run_tag=secrets.token_hex(3) + "-")
    index = np.arange(len(offsets))[share[0] :: share[1]]
    offsets = offsets[index]
    ops = [ops[k] for k in index]
    messages = [messages[k] for k in index]
    n = len(offsets)
    due = np.full(n, np.nan)
    sent = np.full(n, np.nan)
    done = np.full(n, np.nan)
    codes = [""] * n
    partial = np.zeros(n, dtype=bool)
    skipped = np.zeros(n, dtype=bool)
    metadata = target.metadata or None
    channels = [target.aio_channel(i) for i in range(max(1, cfg.channels))]
    try:
        stubs = [callers(ch) for ch in channels]
        for ch in channels:
            try:
                await asyncio.wait_for(ch.channel_ready(), timeout=cfg.timeout_s)
            except TimeoutError:
                raise ConnectionError(
                    f"{target.address}: no connection within {cfg.timeout_s:g} s"
                ) from None
        loop = asyncio.get_running_loop()
        start = (
            loop.time() + START_LEAD_S if start_at is None else await asyncio.to_thread(start_at)
        )

        async def one(i: int) -> None:
            call = stubs[i % len(stubs)][ops[i]]
            sent[i] = loop.time()
            try:
                reply = await call(messages[i], timeout=cfg.timeout_s, metadata=metadata)
            except grpc.aio.AioRpcError as exc:
                codes[i] = exc.code().name
            else:
                codes[i] = "OK"
                partial[i] = is_partial(reply)
                skipped[i] = rerank_skipped(reply)
            finally:
                done[i] = loop.time()

        tasks: set[asyncio.Task[None]] = set()
        for i in range(n):
            due[i] = start + offsets[i]
            wait = due[i] - loop.time()
            # Absolute time: a late wake-up shortens the next wait instead of piling up.
            await asyncio.sleep(wait if wait > 0 else 0)
            if len(tasks) >= cfg.max_in_flight:
                codes[i] = NOT_SENT
                continue
            task = asyncio.create_task(one(i))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)
    finally:
        for ch in channels:
            await ch.close()
    sender = np.full(n, os.getpid())
    return Records(list(ops), due, sent, done, codes, partial, skipped, start, cfg, index, sender)
