"""A replica's log lag is time behind its log, and it grows while the replica applies
nothing.

A real replica process on a real Redis, its /metrics read over HTTP as Prometheus reads
them. The replica's consumer thread is made to stop for real (as in
test_shard_health.py: its snapshot directory becomes a file, so the snapshot after the
next applied change raises); writes after that are never applied. The lag must then
grow with every scrape, although the replica applies nothing (the old gauge, set when a
batch was applied, stayed at its last value and could not alert on a stopped replica).
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.index.client.writer import ChangeLogWriter, DocRecord
from tests.support.processes import free_port
from tests.support.shards import (
    scifact_vectors,
    shared_test_index,
    start_shard_that_stops_applying,
)


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("index_log_")
    }


def await_metrics(
    port: int, condition: Callable[[dict[str, float]], bool], what: str, timeout: float = 30.0
) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        values = scrape(port)
        if condition(values):
            return values
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}; last {values}")
        time.sleep(0.1)


def write(redis_url: str, doc_id: str, vector: np.ndarray) -> None:
    async def run() -> None:
        writer = ChangeLogWriter.connect(redis_url, num_shards=1, dim=vector.shape[0])
        try:
            await writer.upsert([DocRecord(doc_id, vector, "t", "x")])
        finally:
            await writer.close()

    asyncio.run(run())


def test_the_lag_of_a_replica_that_stopped_applying_grows(
    redis_url: str, scifact_dir: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    vectors = scifact_vectors(scifact_dir)
    index_dir = shared_test_index(tmp_path_factory.getbasetemp(), vectors)
    metrics_port = free_port()
    shard = start_shard_that_stops_applying(
        index_dir, redis_url, tmp_path, {"metrics-port": str(metrics_port)}
    )
    try:
        # The consumer will stop after the first change it applies (its snapshot cannot
        # be written). Up to then it is caught up: no lag, the applied entry the newest.
        write(redis_url, "doc-0", vectors[0])
        caught_up = await_metrics(
            metrics_port,
            lambda v: (
                v["index_log_applied_entry_timestamp_seconds"] > 0
                and v["index_log_applied_entry_timestamp_seconds"]
                == v["index_log_newest_entry_timestamp_seconds"]
            ),
            "doc-0 applied",
        )
        assert caught_up["index_log_lag_seconds"] == 0.0
        deadline = time.monotonic() + 30
        while "log consumer of shard 0 stopped" not in shard.log_path.read_text():
            assert time.monotonic() < deadline, shard.log_tail()
            time.sleep(0.05)

        # A write the stopped replica never applies: its lag is the write's age, and it
        # keeps growing while nothing is applied.
        written = time.time()
        write(redis_url, "doc-1", vectors[1])
        first = await_metrics(
            metrics_port,
            lambda v: (
                v["index_log_newest_entry_timestamp_seconds"]
                > v["index_log_applied_entry_timestamp_seconds"]
            ),
            "doc-1 in the log, not applied",
        )
        later = await_metrics(
            metrics_port,
            lambda v: v["index_log_lag_seconds"] >= first["index_log_lag_seconds"] + 1.5,
            "the lag growing while nothing is applied",
        )
        assert later["index_log_lag_seconds"] <= time.time() - written + 1.0
        assert later["index_log_newest_entry_timestamp_seconds"] == pytest.approx(written, abs=2.0)
        assert (
            later["index_log_applied_entry_timestamp_seconds"]
            == first["index_log_applied_entry_timestamp_seconds"]
        )
    finally:
        shard.kill()
