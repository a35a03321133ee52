"""Several sender processes for rates one event loop cannot keep (``--processes N``).

Each process builds the same seeded schedule and requests and sends every N-th of
them (``share``), all against one monotonic start time, so together they send exactly
the schedule one process would; their records are merged back in schedule order. A
Poisson schedule split this way is still the one seeded schedule, not N independent ones.

The processes start with ``spawn`` (no fork of a running event loop or gRPC). The start
is a readiness barrier, not a guess: each sender builds its requests, connects its
channels and reports ready over its pipe; once all have, this process sends every one
the same start time, ``START_DELAY_S`` ahead (time to deliver it and wake their loops).
A sender that fails before it is ready fails the run with its error; one that is not
ready within ``READY_TIMEOUT_S`` too.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
import traceback
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from loadtest.runner import Records, RunConfig, run_open_loop
from loadtest.target import Target
from loadtest.workload import Workload

READY_TIMEOUT_S = 120.0  # a spawned interpreter imports grpc and connects well within it
START_DELAY_S = 0.1  # from "all ready" to offset 0: the start time reaches every sender


class SenderFailed(RuntimeError):
    """A sender process failed (its traceback is the message) or never got ready."""


def _sender(
    conn: Connection, target: Target, workload: Workload, cfg: RunConfig, share: tuple[int, int]
) -> None:
    """One sender process: ready → wait for the common start → send its share → records."""

    def ready() -> float:
        conn.send(("ready", os.getpid()))
        return float(conn.recv())

    try:
        records = asyncio.run(run_open_loop(target, workload, cfg, share=share, start_at=ready))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise
    conn.send(("done", records))


def _receive(conn: Connection, expected: str, timeout: float | None, who: str) -> Any:
    if timeout is not None and not conn.poll(timeout):
        raise SenderFailed(f"{who}: not {expected} within {timeout:g} s")
    try:
        kind, value = conn.recv()
    except EOFError:
        raise SenderFailed(f"{who} exited before it was {expected}") from None
    if kind == "error":
        raise SenderFailed(f"{who} failed:\n{value}")
    assert kind == expected, (kind, expected)
    return value


def _run(target: Target, workload: Workload, cfg: RunConfig, processes: int) -> list[Records]:
    ctx = multiprocessing.get_context("spawn")
    pipes: list[Connection] = []
    procs = []
    try:
        for k in range(processes):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=_sender,
                args=(theirs, target, workload, replace(cfg), (k, processes)),
                name=f"loadtest-sender-{k}",
                daemon=True,
            )
            proc.start()
            theirs.close()  # so that a sender that dies is an EOF here
            pipes.append(mine)
            procs.append(proc)
        deadline = time.monotonic() + READY_TIMEOUT_S
        for k, conn in enumerate(pipes):
            _receive(conn, "ready", max(0.0, deadline - time.monotonic()), f"sender {k}")
        start_at = time.monotonic() + START_DELAY_S
        for conn in pipes:
            conn.send(start_at)
        return [_receive(conn, "done", None, f"sender {k}") for k, conn in enumerate(pipes)]
    finally:
        for conn in pipes:
            conn.close()  # a sender still waiting for the start gets EOF and ends
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(10)


def merge(parts: list[Records], cfg: RunConfig) -> Records:
    """The records of every share, in schedule order, as one run's."""
    index = np.concatenate([p.index for p in parts])
    order = np.argsort(index, kind="stable")

    def cat(name: str) -> np.ndarray:
        return np.concatenate([getattr(p, name) for p in parts])[order]

    ops = [op for p in parts for op in p.ops]
    codes = [c for p in parts for c in p.codes]
    return Records(
        ops=[ops[k] for k in order],
        due=cat("due"),
        sent=cat("sent"),
        done=cat("done"),
        codes=[codes[k] for k in order],
        partial=cat("partial"),
        rerank_skipped=cat("rerank_skipped"),
        start=min(p.start for p in parts),
        config=cfg,
        index=index[order],
        sender=cat("sender"),
    )


async def run_in_processes(
    target: Target, workload: Workload, cfg: RunConfig, processes: int
) -> Records:
    """``run_open_loop`` split over ``processes`` spawned processes (1: in this one)."""
    if processes <= 1:
        return await run_open_loop(target, workload, cfg)
    return merge(await asyncio.to_thread(_run, target, workload, cfg, processes), cfg)
