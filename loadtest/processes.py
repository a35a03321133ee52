"""Several sender processes for rates one event loop cannot keep (``--processes N``).

Each process builds the same seeded schedule and requests and sends every N-th of
them (``share``), all against one monotonic start time, so together they send exactly
the schedule one process would; their records are merged back in schedule order. The
processes start with ``spawn`` (no fork of a running event loop or gRPC) ahead of the
start time; one that comes up late records the lag like any late send. A Poisson
schedule split this way is still the one seeded schedule, not N independent ones.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from dataclasses import replace

import numpy as np

from loadtest.runner import Records, RunConfig, run_open_loop
from loadtest.target import Target
from loadtest.workload import Workload

SPAWN_LEAD_S = 4.0  # time for a spawned interpreter to import grpc and connect


def _one_share(
    target: Target, workload: Workload, cfg: RunConfig, share: tuple[int, int], start_at: float
) -> Records:
    return asyncio.run(run_open_loop(target, workload, cfg, share=share, start_at=start_at))


def merge(parts: list[Records], cfg: RunConfig) -> Records:
    """The records of every share, in schedule order, as one run's."""
    index = np.concatenate([p.index if p.index is not None else np.arange(0) for p in parts])
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
    )


async def run_in_processes(
    target: Target, workload: Workload, cfg: RunConfig, processes: int
) -> Records:
    """``run_open_loop`` split over ``processes`` spawned processes (1: in this one)."""
    if processes <= 1:
        return await run_open_loop(target, workload, cfg)
    start_at = time.monotonic() + SPAWN_LEAD_S
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(processes) as pool:
        args = [
            (target, workload, replace(cfg), (k, processes), start_at) for k in range(processes)
        ]
        parts = await asyncio.to_thread(pool.starmap, _one_share, args)
    return merge(parts, cfg)
