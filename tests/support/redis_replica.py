"""A real redis-server replicating a primary (``--replicaof``), for WAIT and its cost."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from tests.support.processes import free_port, start_redis, stop_process, wait_until


def wait_replica_synced(replica: redis.Redis, timeout: float = 30.0) -> None:
    """Until the replica's link to its primary is up (its initial sync done)."""
    wait_until(
        lambda: replica.info("replication").get("master_link_status") == "up",
        "the replica synced with its primary",
        timeout=timeout,
    )


@contextmanager
def run_redis_replica(
    primary_port: int, data_dir: Path, fsync: str = "always"
) -> Iterator[subprocess.Popen[bytes]]:
    """A replica of the redis-server on ``primary_port`` (AOF on), once it is in sync."""
    port = free_port()
    proc = start_redis(data_dir, port, fsync, ("--replicaof", "127.0.0.1", str(primary_port)))
    try:
        client = redis.Redis(host="127.0.0.1", port=port)
        try:
            wait_replica_synced(client)
        finally:
            client.close()
        yield proc
    finally:
        stop_process(proc)
