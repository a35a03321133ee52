"""Real index shard servers for tests: trained index, processes on free ports, readiness.

Reusable by any test that needs shards (the gateway's too)::

    index_dir = train_test_index(vectors, tmp_path / "index")
    with run_shards(index_dir, redis_url, tmp_path, shards=2, replicas=1) as cluster:
        router = ShardRouter(cluster.addresses)
        ...
        cluster.replica(0).kill()        # SIGKILL, like an OOM kill
        cluster.replica(0).restart()     # same port, same snapshot directory

Each replica is a separate ``python -m services.index.server.process`` process, so a kill -9 is
a real crash. ``start_shard`` waits until the gRPC health service reports SERVING (the
shard replays its log before it does).

For tests of the shard's core in-process, the module-scoped fixtures ``vectors`` (the
SciFact embeddings) and ``trained`` (the session's index trained on them, loaded): import
them into the test module.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.index.client.writer import ChangeLogWriter, DocRecord
from tests.support.processes import free_port

if TYPE_CHECKING:
    from services.index.core.trained import TrainedIndex

ROOT = Path(__file__).resolve().parents[2]

# Defaults that keep a test shard light on a 2-core machine.
TEST_SETTINGS: dict[str, str] = {
    "omp-threads": "1",
    "search-threads": "2",
    "snapshot-every-s": "3600",
    "snapshot-every-entries": "1000000",
    "grace-seconds": "1",
    "log-level": "WARNING",
}


def train_test_index(
    vectors: np.ndarray, out_dir: Path, *, nlist: int | None = None, **options: object
) -> Path:
    """Train IVF-PQ (+ SQ8 refine) on ``vectors`` into ``out_dir`` (reused when present)."""
    from services.index.core.train import TrainOptions, train_index
    from services.index.core.trained import MANIFEST

    if not (out_dir / MANIFEST).exists():
        train_index(
            vectors,
            out_dir,
            TrainOptions(nlist=nlist, model="all-MiniLM-L6-v2", **options),  # type: ignore[arg-type]
        )
    return out_dir


@dataclass
class ShardProcess:
    """One replica process of one shard."""

    shard: int
    replica: str
    port: int
    snapshot_dir: Path
    argv: list[str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    host: str = "127.0.0.1"  # any loopback address: replicas of a shard behind one DNS name

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def spawn(self) -> None:
        """Start the process (its output appends to ``log_path``); do not wait."""
        self.snapshot_dir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self.argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=_env()
            )

    def launch(self, timeout: float = 60.0) -> None:
        """Start the process and wait until it serves."""
        self.spawn()
        self.wait_serving(timeout)

    def wait_serving(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if not self.alive:
                    raise RuntimeError(
                        f"shard {self.shard} {self.replica} exited:\n{self.log_tail()}"
                    )
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.05)
        raise TimeoutError(f"shard {self.shard} {self.replica} not serving:\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL: no snapshot, no goodbye."""
        if self.process is not None and self.alive:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM: drain, final snapshot, exit."""
        if self.process is not None and self.alive:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)

    def restart(self, timeout: float = 60.0) -> None:
        """Start again on the same port with the same snapshot directory."""
        self.stop()
        self.launch(timeout)

    def log_tail(self, lines: int = 30) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def shard_argv(
    *,
    index_dir: Path,
    redis_url: str,
    shard: int,
    shards: int,
    replica: str,
    port: int,
    snapshot_dir: Path,
    settings: Mapping[str, str] | None = None,
) -> list[str]:
    merged = {**TEST_SETTINGS, **(settings or {})}
    argv = [
        sys.executable,
        "-m",
        "services.index.server.process",
        "--shard",
        str(shard),
        "--shards",
        str(shards),
        "--replica",
        replica,
        "--port",
        str(port),
        "--redis-url",
        redis_url,
        "--index-dir",
        str(index_dir),
        "--snapshot-dir",
        str(snapshot_dir),
    ]
    for key, value in merged.items():
        argv += [f"--{key}", value]
    return argv


def start_shard(
    *,
    index_dir: Path,
    redis_url: str,
    shard: int,
    shards: int,
    work_dir: Path,
    replica: str | None = None,
    port: int | None = None,
    settings: Mapping[str, str] | None = None,
    timeout: float = 60.0,
    wait: bool = True,
    host: str = "127.0.0.1",
) -> ShardProcess:
    """Start one replica process; with ``wait``, until it serves (its log replayed).
    ``host``: the loopback address it listens on (127.0.0.2, ... for replicas that one
    DNS name resolves to, on one port)."""
    replica = replica or f"shard-{shard}-r0"
    port = port or free_port()
    settings = {**(settings or {}), "host": host}
    snapshot_dir = work_dir / "snapshots" / replica
    proc = ShardProcess(
        shard=shard,
        replica=replica,
        port=port,
        snapshot_dir=snapshot_dir,
        argv=shard_argv(
            index_dir=index_dir,
            redis_url=redis_url,
            shard=shard,
            shards=shards,
            replica=replica,
            port=port,
            snapshot_dir=snapshot_dir,
            settings=settings,
        ),
        log_path=work_dir / f"{replica}.log",
        host=host,
    )
    proc.spawn()
    if wait:
        proc.wait_serving(timeout)
    return proc


def start_shard_that_stops_applying(
    index_dir: Path, redis_url: str, work_dir: Path, settings: Mapping[str, str] | None = None
) -> ShardProcess:
    """Shard 0 of 1, SERVING and following its log until the first change it applies:
    it then snapshots (``snapshot-every-entries`` 1) into a "directory" that is a file,
    and its log consumer stops. ``snapshot_dir.unlink()`` repairs it for a restart.

    Its text index lives outside the snapshot directory (``text-dir``): by default it
    is under it, and removing it would fail the first apply at the text commit, before
    the change counts as applied, instead of at the snapshot after it."""
    shard = start_shard(
        index_dir=index_dir,
        redis_url=redis_url,
        shard=0,
        shards=1,
        work_dir=work_dir,
        settings={
            "snapshot-every-entries": "1",
            "text-dir": str(work_dir / "text"),
            **(settings or {}),
        },
    )
    shutil.rmtree(shard.snapshot_dir)
    shard.snapshot_dir.write_text("not a directory")
    return shard


@dataclass
class ShardCluster:
    """Every replica of every shard: ``processes[shard][replica]``."""

    processes: list[list[ShardProcess]]

    @property
    def addresses(self) -> list[list[str]]:
        return [[p.address for p in replicas] for replicas in self.processes]

    def replica(self, shard: int, index: int = 0) -> ShardProcess:
        return self.processes[shard][index]

    def all(self) -> Sequence[ShardProcess]:
        return [p for replicas in self.processes for p in replicas]

    def stop(self) -> None:
        for proc in self.all():
            proc.stop()


@contextmanager
def run_shards(
    index_dir: Path,
    redis_url: str,
    work_dir: Path,
    *,
    shards: int,
    replicas: int = 1,
    settings: Mapping[str, str] | None = None,
    timeout: float = 60.0,
) -> Iterator[ShardCluster]:
    """``shards`` × ``replicas`` shard processes on free ports; stopped on exit."""
    cluster = ShardCluster([[] for _ in range(shards)])
    try:
        for shard in range(shards):
            for r in range(replicas):
                cluster.processes[shard].append(
                    start_shard(
                        index_dir=index_dir,
                        redis_url=redis_url,
                        shard=shard,
                        shards=shards,
                        work_dir=work_dir,
                        replica=f"shard-{shard}-r{r}",
                        settings=settings,
                        wait=False,
                    )
                )
        for proc in cluster.all():
            proc.wait_serving(timeout)
        yield cluster
    finally:
        cluster.stop()


def scifact_vectors(scifact_dir: Path) -> np.ndarray:
    """The 5,183 SciFact document embeddings (float32, 384-d, L2-normalised)."""
    path = scifact_dir / "corpus.all-MiniLM-L6-v2.npy"
    if not path.exists():
        pytest.fail(f"{path} not found: the tests need it (set GTR_DATA_DIR)")
    return np.load(path)


def one_fed_shard_index(
    redis_url: str, scifact_dir: Path, root: Path, docs: int
) -> tuple[np.ndarray, Path]:
    """For one replica of a one-shard index: SciFact's first 1,000 embeddings, an index
    trained on them under ``root`` (8 lists) and the first ``docs`` of them upserted into
    shard 0's log (``d0``, ``d1``, ...); the vectors and the index folder."""
    vectors = scifact_vectors(scifact_dir)[:1000].astype(np.float32)
    index_dir = train_test_index(vectors, root / "index", nlist=8)

    async def ingest() -> None:
        writer = ChangeLogWriter.connect(redis_url, num_shards=1, dim=vectors.shape[1])
        await writer.upsert([DocRecord(f"d{i}", vectors[i]) for i in range(docs)])
        await writer.close()

    asyncio.run(ingest())
    return vectors, index_dir


def shared_test_index(base_tmp: Path, vectors: np.ndarray) -> Path:
    """One trained index per test session (trained on first use, under pytest's basetemp)."""
    return train_test_index(vectors, base_tmp / "index-scifact")


@pytest.fixture(scope="module")
def vectors(scifact_dir: Path) -> np.ndarray:
    """The SciFact document embeddings (:func:`scifact_vectors`)."""
    return scifact_vectors(scifact_dir)


@pytest.fixture(scope="module")
def trained(vectors: np.ndarray, tmp_path_factory: pytest.TempPathFactory) -> TrainedIndex:
    """The session's index trained on ``vectors`` (:func:`shared_test_index`), loaded."""
    from services.index.core.trained import TrainedIndex

    return TrainedIndex.load(shared_test_index(tmp_path_factory.getbasetemp(), vectors))
