"""A real redis-server replicating a primary (``--replicaof``), for WAIT and its cost."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from tests.support.processes import free_port, redis_binary, stop_process, wait_for_port


@contextmanager
def run_redis_replica(
    primary_port: int, data_dir: Path, fsync: str = "always"
) -> Iterator[subprocess.Popen[bytes]]:
    """A replica of the redis-server on ``primary_port`` (AOF on), once it is in sync."""
    binary = redis_binary()
    if binary is None:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
    data_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    proc = subprocess.Popen(
        [
            binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data_dir),
            "--replicaof", "127.0.0.1", str(primary_port),
            "--appendonly", "yes", "--appendfsync", fsync, "--save", "",
            "--daemonize", "no", "--protected-mode", "no", "--loglevel", "warning",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for_port(port, 20)
        client = redis.Redis(host="127.0.0.1", port=port)
        deadline = time.monotonic() + 30
        while client.info("replication").get("master_link_status") != "up":
            if time.monotonic() > deadline:
                raise TimeoutError("the replica did not sync with its primary in 30 s")
            time.sleep(0.05)
        client.close()
        yield proc
    finally:
        stop_process(proc)
