"""Drift that acts (issue #24), against real shards: `index drift-watch` reads the
PQ error ratio the shard replicas report over their Stats RPC (real processes, real
Redis) and starts the rollout when it stays above the threshold.

The shards' quantizer is trained on vectors of an 8-dimensional subspace of R^64; the
documents then added spread over all 64 dimensions, so their PQ reconstruction error is
many times the error at training: the drift of issue #24's stdlib-then-SciFact stack,
made in a few seconds.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
import redis

from services.generations.drift import (
    DRIFT_KEY,
    DriftPolicy,
    DriftWatcher,
    WatchConfig,
    read_ratios,
    read_with_asyncio,
)
from services.generations.registry import EncoderSpec, Registry
from services.index.client.writer import ChangeLogWriter, DocRecord
from tests.support.processes import wait_until
from tests.support.shards import ShardCluster, run_shards, train_test_index

ROOT = Path(__file__).resolve().parents[2]
REDIS_DB = 11  # module_redis: the shards outlive the per-test flush of db 0
DIM = 64
SHARDS = 2


def _normalised(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shards' quantizer, trained on an 8-dimensional subspace."""
    rng = np.random.default_rng(8)
    trained_on = _normalised(rng.standard_normal((3000, 8)) @ rng.standard_normal((8, DIM)))
    return train_test_index(
        trained_on, tmp_path_factory.mktemp("drift-index") / "index", nlist=16, nprobe=4
    )


@pytest.fixture(scope="module")
def drifted(
    index_dir: Path, module_redis: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ShardCluster]:
    rng = np.random.default_rng(24)
    added = _normalised(rng.standard_normal((600, DIM)))

    async def load() -> None:
        writer = ChangeLogWriter.connect(module_redis, SHARDS, dim=DIM)
        try:
            await writer.upsert(
                [DocRecord(f"d{i}", v, text=f"doc {i}") for i, v in enumerate(added)]
            )
        finally:
            await writer.close()

    asyncio.run(load())  # logged before the shards start: they replay it
    with run_shards(
        index_dir, module_redis, tmp_path_factory.mktemp("drift-shards"), shards=SHARDS
    ) as cluster:
        yield cluster


def spec(cluster: ShardCluster) -> str:
    return ";".join(",".join(replicas) for replicas in cluster.addresses)


@pytest.mark.slow
def test_the_shards_report_the_drift(drifted: ShardCluster) -> None:
    reading = asyncio.run(read_ratios(spec(drifted)))
    assert reading.answered == SHARDS
    assert all(len(shard) == 1 and shard[0] > 1.5 for shard in reading.per_shard), reading
    assert reading.ratio == max(r for shard in reading.per_shard for r in shard)


def test_the_watcher_starts_the_retrain_after_the_window(
    drifted: ShardCluster, module_redis: str, index_dir: Path
) -> None:
    client = redis.Redis.from_url(module_redis)
    registry = Registry(client)
    registry.ensure_first(SHARDS, EncoderSpec("embed", 0, DIM), str(index_dir))
    runs: list[list[str]] = []

    def run(argv: Sequence[str]) -> int:
        runs.append(list(argv))
        return 0

    now = [0.0]
    config = WatchConfig(
        policy=DriftPolicy(threshold=1.5, window_s=60, stale_s=100),
        interval_s=30,
        fallback_shards=spec(drifted),
        rollout_argv=["gtr-retrieval", "index", "rollout", "--retrain", "--yes"],
    )
    watcher = DriftWatcher(config, registry, read_with_asyncio(), run, clock=lambda: now[0])
    for t in (0.0, 30.0):
        now[0] = t
        assert not watcher.poll()
    now[0] = 60.0
    assert watcher.poll()
    assert runs == [["gtr-retrieval", "index", "rollout", "--retrain", "--yes"]]
    # the same shards under a threshold above their ratio: never
    calm = DriftWatcher(
        WatchConfig(DriftPolicy(1e6, 0, 100), 30, spec(drifted), ["never"]),
        registry,
        read_with_asyncio(),
        run,
        clock=lambda: now[0],
    )
    assert not calm.poll() and len(runs) == 1
    client.close()


def test_drift_watch_once_prints_the_reading(
    drifted: ShardCluster, module_redis: str, index_dir: Path
) -> None:
    client = redis.Redis.from_url(module_redis)
    Registry(client).ensure_first(SHARDS, EncoderSpec("embed", 0, DIM), str(index_dir))
    client.close()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli.main",
            "index",
            "drift-watch",
            f"--redis-url={module_redis}",
            "--threshold=1.5",
            "--window=1h",
            f"--shards={spec(drifted)}",
            "--once",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    reading = json.loads(done.stdout.strip().splitlines()[-1])
    assert reading["generation"] == "g1" and reading["above"] is True
    assert reading["ratio"] > 1.5 and len(reading["per_shard"]) == SHARDS


def test_drift_watch_runs_the_real_retrain_and_stops_on_sigterm(
    drifted: ShardCluster, module_redis: str, index_dir: Path, tmp_path: Path
) -> None:
    """The whole chain, last in the module (it switches the store to g2): the watcher
    process reads the drifted shards, runs the real `index rollout --retrain` (which
    exports their vectors, trains g2 and switches the alias; nothing runs g2's shards
    here, hence --no-shard-wait), records it, and ends on SIGTERM."""
    client = redis.Redis.from_url(module_redis)
    registry = Registry(client)
    registry.ensure_first(SHARDS, EncoderSpec("embed", 0, DIM), str(index_dir))
    client.delete(DRIFT_KEY)  # the in-process watcher of a test above wrote it
    log = (tmp_path / "drift-watch.log").open("wb")
    watcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.cli.main",
            "index",
            "drift-watch",
            f"--redis-url={module_redis}",
            "--threshold=1.5",
            "--window=0",
            "--interval=1",
            f"--shards={spec(drifted)}",
            f"--rollout-arg=--index-root={tmp_path / 'gens'}",
            "--rollout-arg=--no-shard-wait",
            "--rollout-arg=--quiet",
        ],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_until(
            lambda: registry.redis.hget(DRIFT_KEY, "rollout") in (b"done", b"failed"),
            "the watcher's rollout ended",
            timeout=180,
            interval=0.5,
        )
        assert registry.redis.hget(DRIFT_KEY, "rollout") == b"done", (
            tmp_path / "drift-watch.log"
        ).read_text()
        assert registry.alias().serving == "g2"
        g2 = registry.get("g2")
        assert g2.params.get("trained") and g2.num_shards == SHARDS
        assert Path(g2.index_dir) == tmp_path / "gens" / "g2"
        assert registry.running() is None
        watcher.send_signal(signal.SIGTERM)
        assert watcher.wait(timeout=30) == 0
    finally:
        if watcher.poll() is None:
            watcher.kill()
        log.close()
        client.close()
