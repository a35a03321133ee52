"""The local stack's supervisor with real children: a real redis-server and real index
shard processes, started by the same :class:`Child` / :class:`Supervisor` and
``components`` functions that ``gtr-retrieval up`` uses, then ``kill -9``-ed.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import redis

from services.index.client.router import ShardRouter
from services.index.client.writer import ChangeLogWriter, DocRecord
from services.index.core.query import Consistency, IndexQuery
from services.index.keys import DocKeys
from services.process.cpus import parent_pid
from services.stack import components, triton_component
from services.stack.children import (
    STOP_GRACE_S,
    Child,
    RestartPolicy,
    State,
    Supervisor,
    grpc_healthy,
)
from services.stack.config import StackConfig
from tests.support.processes import await_until, redis_binary, wait_until

# Slow as a whole: whole stacks killed and restarted.
pytestmark = pytest.mark.slow

DIM = 384
FAST = RestartPolicy(backoff_s=0.05, backoff_max_s=0.2, max_restarts=2, window_s=60, poll_s=0.05)


def unit_vectors(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    v = rng.standard_normal((n, DIM)).astype(np.float32)
    return np.asarray(v / np.linalg.norm(v, axis=1, keepdims=True))


@pytest.fixture
def cfg(tmp_path: Path) -> StackConfig:
    if redis_binary() is None:
        pytest.fail("redis-server is not installed (scripts/bootstrap.sh installs it)")
    return StackConfig(run_dir=tmp_path / "run", shards=1, replicas=2, restart=FAST)


def start_redis(sup: Supervisor, cfg: StackConfig) -> Child:
    child = components.redis_child(cfg)
    return sup.start(child, lambda: components.redis_ready(child), 30)


def test_kill_9_of_a_replica_and_of_redis_restarts_them_healthy(cfg: StackConfig) -> None:
    """The replicas forked by the fork server, as ``up`` starts them: restarted by a fork
    too, and stopped on SIGTERM."""
    from services.index.core.train import TrainOptions, train_index
    from services.stack.forking import ForkServer

    train_index(unit_vectors(1000, 0), cfg.index_dir, TrainOptions(nlist=8, pq_m=8, pq_bits=4))
    reports: list[str] = []
    sup = Supervisor(cfg.restart, report=reports.append)
    fork = ForkServer()
    fork.start()
    try:
        redis_child = start_redis(sup, cfg)
        replicas = [components.shard_child(cfg, 0, r) for r in range(2)]
        for child in replicas:
            child.spawn = fork.spawn
            sup.start(child, lambda c=child: components.grpc_ready(c), 60)  # type: ignore[misc]
        sup.watch()
        server = {parent_pid(c.pid) for c in replicas if c.pid is not None}
        assert len(server) == 1 and os.getpid() not in server  # the fork server's children
        victim = replicas[1]
        docs = unit_vectors(40, 1)

        async def scenario() -> None:
            writer = ChangeLogWriter.connect(redis_child.address, 1, dim=DIM)
            solo = ShardRouter([[victim.address]])  # only the victim: no failover to hide it

            async def found(row: int) -> bool:
                try:
                    # k ≥ all documents: the SQ8 refine ranks every one exactly
                    query = IndexQuery(docs[row : row + 1], 50, consistency=Consistency.STRONG)
                    result = await solo.search(query, timeout=2)
                except Exception:
                    return False
                return bool(result.hits[0]) and result.hits[0][0].id == f"d{row}"

            try:
                await writer.upsert([DocRecord(f"d{i}", docs[i]) for i in range(20)])
                await await_until(lambda: found(3), "the replica searches the upserts", 30)

                # kill -9 of one replica: restarted on the same port, healthy, searched again
                old_pid = victim.pid
                assert old_pid is not None
                os.kill(old_pid, signal.SIGKILL)
                await asyncio.to_thread(
                    wait_until,
                    lambda: victim.restarts == 1 and victim.state is State.RUNNING,
                    "the replica restarted and healthy",
                    45,
                )
                assert victim.pid != old_pid and grpc_healthy(victim.address)
                assert victim.pid is not None and {parent_pid(victim.pid)} == server  # forked
                assert all(c.alive() for c in sup.children)
                # the router's channel and search stream to that port come back by themselves
                await await_until(lambda: found(7), "the router searches the restarted replica", 20)

                # kill -9 of Redis: same port, same AOF directory, nothing acknowledged lost
                old_pid = redis_child.pid
                assert old_pid is not None
                os.kill(old_pid, signal.SIGKILL)
                await asyncio.to_thread(
                    wait_until,
                    lambda: redis_child.restarts == 1 and redis_child.state is State.RUNNING,
                    "redis restarted and healthy",
                    30,
                )
                client = redis.Redis.from_url(redis_child.address)
                assert client.exists(*[DocKeys(1).doc(f"d{i}") for i in range(20)]) == 20
                client.close()

                async def upserted() -> bool:
                    try:
                        await writer.upsert([DocRecord(f"d{i}", docs[i]) for i in range(20, 40)])
                        return True
                    except Exception:
                        return False

                await await_until(upserted, "an upsert after the Redis restart", 20)
                # the shards' log consumers reconnected to the restarted Redis
                await await_until(
                    lambda: found(33), "a write after the Redis restart is searched", 30
                )
            finally:
                await writer.close()
                await solo.close()

        asyncio.run(scenario())
        assert sup.restart_counts() == {
            "redis": 1,
            "shard-0-replica-0": 0,
            "shard-0-replica-1": 1,
        }
        assert sup.failure is None
        assert any("shard-0-replica-1 killed by SIGKILL; restart 1" in r for r in reports)
        assert any("shard-0-replica-1 healthy again" in r for r in reports)
        assert "supervisor: shard-0-replica-1 healthy again" in victim.log_tail(200)
    finally:
        killed = sup.stop_all()
    assert killed == []  # every child stopped on SIGTERM
    assert not any(c.alive() for c in sup.children)


def test_a_child_that_keeps_failing_stops_every_child(cfg: StackConfig, tmp_path: Path) -> None:
    gave_up = threading.Event()
    messages: list[str] = []

    def on_give_up(message: str) -> None:
        messages.append(message)
        gave_up.set()

    sup = Supervisor(cfg.restart, on_give_up=on_give_up)
    try:
        victim = start_redis(sup, cfg)
        other_cfg = StackConfig(run_dir=tmp_path / "other", restart=cfg.restart)
        other = components.redis_child(other_cfg)
        other.name = "other-redis"
        sup.start(other, lambda: components.redis_ready(other), 30)
        sup.watch()
        # Its data directory is gone: every restart exits at once ("Can't chdir").
        shutil.rmtree(cfg.redis_dir)
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        assert gave_up.wait(30), "the supervisor did not give up"
        assert sup.failure is not None and sup.failure.startswith("redis ")
        assert "failed 3 times within 60 s" in sup.failure
        assert victim.restarts == cfg.restart.max_restarts
        assert messages == [sup.failure]
        assert not other.alive() and other.state is State.STOPPED
        assert "giving up" in victim.log_tail()
    finally:
        sup.stop_all()
    assert not any(c.alive() for c in sup.children)


def _sleeper(tmp_path: Path, name: str, script: str = "sleep 60") -> Child:
    return Child(name, ["sh", "-c", script], tmp_path / f"{name}.log")


def test_a_child_that_is_not_essential_is_given_up_on_alone(tmp_path: Path) -> None:
    """A shard of a generation that does not serve: failing past the policy, it is left
    stopped; the rest serves on (an essential one would stop everything, as above)."""
    gave_up: list[str] = []
    sup = Supervisor(FAST, on_give_up=gave_up.append)
    try:
        steady = sup.start(_sleeper(tmp_path, "steady"), lambda: True, 10)
        flaky = _sleeper(tmp_path, "flaky", "sleep 0.3; exit 3")
        flaky.essential = False
        sup.start(flaky, lambda: True, 10)
        sup.watch()
        wait_until(lambda: flaky.state is State.STOPPED, "the flaky child given up on", 30)
        assert flaky.restarts == FAST.max_restarts and not flaky.alive()
        assert sup.failure is None and not gave_up
        assert steady.alive() and steady.state is State.RUNNING
        assert "giving up on it, the rest of the stack serves on" in flaky.log_path.read_text()
    finally:
        sup.stop_all()


def test_a_removed_child_is_stopped_and_its_pending_restart_dropped(tmp_path: Path) -> None:
    """The shards of a retired generation: :meth:`Supervisor.remove` stops them for good,
    even one that crashed and waits for its restart."""
    # a 3-s backoff: the removal below comes well before the restart on a slow machine too
    slow = RestartPolicy(backoff_s=3.0, backoff_max_s=3.0, max_restarts=5, window_s=60, poll_s=0.05)
    sup = Supervisor(slow)
    try:
        keep = sup.start(_sleeper(tmp_path, "keep"), lambda: True, 10)
        crashed = sup.start(_sleeper(tmp_path, "crashed"), lambda: True, 10)
        running = sup.start(_sleeper(tmp_path, "running"), lambda: True, 10)
        sup.watch()
        assert crashed.pid is not None
        os.kill(crashed.pid, signal.SIGKILL)
        wait_until(lambda: crashed.state is State.RESTARTING, "the crash noticed", 10)
        assert sup.remove([crashed, running]) == []  # both stopped on SIGTERM (or dead)
        assert not running.alive() and sup.children == [keep]
        wait_until(
            lambda: not any(t.is_alive() for t in sup._threads), "the restart thread ended", 30
        )
        assert crashed.restarts == 0 and not crashed.alive()
        assert crashed.state is State.STOPPED and keep.alive()
    finally:
        sup.stop_all()


def test_backoff_doubles_up_to_its_cap() -> None:
    policy = RestartPolicy(backoff_s=0.5, backoff_max_s=3.0)
    assert [policy.delay(n) for n in (1, 2, 3, 4, 5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    with pytest.raises(ValueError):
        RestartPolicy(window_s=0)


def _metrics_answer(metrics_address: str) -> bool:
    """Triton starts its metrics endpoint after its gRPC service (the one readiness is
    checked on): a ready server may still refuse a metrics read for a moment."""
    try:
        _pending_inferences(metrics_address)
    except OSError:
        return False
    return True


def _pending_inferences(metrics_address: str) -> float:
    import urllib.request

    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=2) as reply:
        text = reply.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("nv_inference_pending_request_count")
    )


# A client of Triton in a process of its own, as the gateway is: ``argv[1]`` = Triton's
# gRPC address; 12 concurrent calls of 64 ~180-token documents, for ever (~10 s of
# queued work at any time on 2 cores).
LOAD = """
import asyncio, sys
from services.encoder.runtime.triton_client import TritonEncoder, TritonEncoderConfig

async def main() -> None:
    encoder = await TritonEncoder.connect(TritonEncoderConfig(sys.argv[1], default_timeout_s=120))
    text = "the quick brown fox jumps over the lazy dog " * 20

    async def client() -> None:
        while True:
            try:
                await encoder.encode([text] * 64, "document")
            except Exception:
                await asyncio.sleep(0.05)

    await asyncio.gather(*[client() for _ in range(12)])

asyncio.run(main())
"""


def test_triton_under_load_stops_on_sigterm_without_sigkill(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The stack's tritonserver (argv and env of ``triton_command``), busy with a queue
    of a client in another process, stopped the way ``up`` stops it: its client (the
    gateway) first, then Triton with SIGTERM. It exits by itself within a few seconds:
    the cancelled requests leave its queue, the model stops running rows nobody waits
    for (``embed_onnx`` checks ``is_cancelled()`` between pieces of rows), it unloads the
    model and exits 0."""
    import subprocess
    import sys

    pytest.importorskip("tritonclient.grpc")
    from services.encoder.build.repository import generate_repository
    from services.encoder.model import default_model_dir
    from services.encoder.serve.triton_server import (
        TritonServerConfig,
        pytriton_root,
        triton_command,
    )
    from tests.encoder_fixtures import encoder_base, ensure_onnx

    try:
        pytriton_root()
    except Exception as exc:
        pytest.fail(f"tritonserver is not available (nvidia-pytriton installs it): {exc}")
    repo = tmp_path / "repo"
    generate_repository(ensure_onnx(default_model_dir(), encoder_base(tmp_path_factory)), repo)
    ports = [components.free_port() for _ in range(3)]
    server = TritonServerConfig(repo, grpc_port=ports[0], http_port=ports[1], metrics_port=ports[2])
    argv, env = triton_command(server)
    # Triton's own default (30 s) outlasts the grace: a busy server was SIGKILLed.
    assert f"--exit-timeout-secs={server.exit_timeout_s}" in argv
    assert server.exit_timeout_s < STOP_GRACE_S
    child = Child("triton", argv, tmp_path / "triton.log", env=env)
    load: subprocess.Popen[bytes] | None = None
    child.start()
    try:
        child.wait_ready(lambda: triton_component.triton_ready(server.grpc_url, "embed"), 120)
        metrics = f"127.0.0.1:{ports[2]}"
        wait_until(lambda: _metrics_answer(metrics), "Triton's metrics endpoint", timeout=30)
        load = subprocess.Popen([sys.executable, "-c", LOAD, server.grpc_url])
        wait_until(lambda: _pending_inferences(metrics) >= 6, "a queue at Triton", timeout=60)
        load.terminate()  # the gateway stops before Triton
        load.wait()
        start = time.monotonic()
        killed = child.stop()
        seconds = time.monotonic() - start
        assert not killed, f"tritonserver needed SIGKILL:\n{child.log_tail()}"
        assert seconds < STOP_GRACE_S
        assert child.process is not None and child.process.returncode == 0
        assert "Signal (15) received" in child.log_tail(200)
    finally:
        if load is not None:
            load.kill()
            load.wait()
        child.stop(grace=1.0)
