"""A real Redis Cluster for tests: 3 primaries + 3 replicas on free ports.

Each node is ``redis-server --cluster-enabled yes --appendonly yes --appendfsync always``
with a short ``cluster-node-timeout`` (a killed primary's replica is promoted within a
few seconds); ``redis-cli --cluster create ... --cluster-replicas 1 --cluster-yes`` joins
them, and :func:`run_redis_cluster` returns once every node reports ``cluster_state:ok``
and every replica is in sync with its primary.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from tests.support.processes import (
    free_port,
    redis_binary,
    stop_process,
    wait_for_port,
    wait_until,
)

NODE_TIMEOUT_MS = 1000


@dataclass
class ClusterNode:
    port: int
    bus_port: int
    data_dir: Path
    password: str | None = None  # requirepass + masterauth (AUTH on every node)
    tls: Path | None = None  # a make_certs() directory: TLS only (clients, bus, replication)
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def client(self) -> redis.Redis:
        tls: dict[str, Any] = (
            {"ssl": True, "ssl_ca_certs": str(self.tls / "ca.pem")} if self.tls else {}
        )
        return redis.Redis(
            host="127.0.0.1", port=self.port, password=self.password, socket_timeout=5.0, **tls
        )

    def start(self) -> None:
        binary = redis_binary()
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        auth = (
            ["--requirepass", self.password, "--masterauth", self.password] if self.password else []
        )
        ports = ["--port", str(self.port)]
        if self.tls:
            ports = [
                "--port",
                "0",
                "--tls-port",
                str(self.port),
                "--tls-cluster",
                "yes",
                "--tls-replication",
                "yes",
                "--tls-auth-clients",
                "no",
                "--tls-cert-file",
                str(self.tls / "server.pem"),
                "--tls-key-file",
                str(self.tls / "server.key"),
                "--tls-ca-cert-file",
                str(self.tls / "ca.pem"),
            ]
        self.process = subprocess.Popen(
            [
                *[binary, *auth, *ports],
                "--cluster-port",
                str(self.bus_port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.data_dir),
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                str(NODE_TIMEOUT_MS),
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--save",
                "",
                "--daemonize",
                "no",
                "--protected-mode",
                "no",
                "--loglevel",
                "warning",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for_port(self.port, 20)

    def kill(self) -> None:
        """SIGKILL: no goodbye to the cluster, its replica has to take over."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


@dataclass
class RedisCluster:
    nodes: list[ClusterNode]

    @property
    def url(self) -> str:
        password, tls = self.nodes[0].password, self.nodes[0].tls
        auth = f":{password}@" if password else ""
        nodes = ",".join(n.address for n in self.nodes)
        if tls:
            return f"rediss+cluster://{auth}{nodes}/?ssl_ca_certs={tls / 'ca.pem'}"
        return f"redis+cluster://{auth}{nodes}"

    def info(self, node: ClusterNode, section: str) -> dict[str, str]:
        """``CLUSTER INFO`` (section "cluster") or an ``INFO`` section of ``node``."""
        client = node.client()
        try:
            if section != "cluster":
                return {str(k): str(v) for k, v in client.info(section).items()}
            raw = client.execute_command("CLUSTER INFO")
        finally:
            client.close()
        if isinstance(raw, dict):
            return {str(k): str(v) for k, v in raw.items()}
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)

    def primaries(self) -> list[ClusterNode]:
        return [n for n in self.nodes if n.alive and self.role(n) == "master"]

    def role(self, node: ClusterNode) -> str:
        return self.info(node, "replication").get("role", "")

    def primary_of(self, key: str) -> ClusterNode:
        """The live primary that serves ``key``'s slot now (the others answer MOVED)."""
        for node in self.primaries():
            client = node.client()
            try:
                client.exists(key)
                return node
            except redis.ResponseError:
                continue
            finally:
                client.close()
        raise LookupError(f"no live primary serves {key!r}")

    def healthy(self) -> bool:
        """Every live node sees the cluster OK and every replica is in sync."""
        for node in self.nodes:
            if not node.alive:
                continue
            try:
                if self.info(node, "cluster").get("cluster_state") != "ok":
                    return False
                repl = self.info(node, "replication")
                if repl.get("role") == "slave" and repl.get("master_link_status") != "up":
                    return False
            except redis.RedisError:
                return False
        return True

    def flush(self) -> None:
        """FLUSHALL on every primary (replicas follow), script caches included."""
        for node in self.primaries():
            client = node.client()
            try:
                client.flushall()
            finally:
                client.close()


@contextmanager
def run_redis_cluster(
    work_dir: Path, primaries: int = 3, password: str | None = None, tls: Path | None = None
) -> Iterator[RedisCluster]:
    """``primaries`` primaries with one replica each, joined into a cluster; stopped on exit."""
    cli = shutil.which("redis-cli") or "/usr/bin/redis-cli"
    if not Path(cli).exists():
        raise RuntimeError("redis-cli is not installed (apt-get install redis-server)")
    nodes = []
    used: set[int] = set()
    for i in range(2 * primaries):
        ports: list[int] = []
        while len(ports) < 2:
            port = free_port()
            if port not in used:
                used.add(port)
                ports.append(port)
        nodes.append(ClusterNode(ports[0], ports[1], work_dir / f"node-{i}", password, tls))
    cluster = RedisCluster(nodes)
    try:
        for node in nodes:
            node.start()
        subprocess.run(
            [
                cli,
                *(["-a", password, "--no-auth-warning"] if password else []),
                *(["--tls", "--cacert", str(tls / "ca.pem")] if tls else []),
                "--cluster",
                "create",
                *[n.address for n in nodes],
                "--cluster-replicas",
                "1",
                "--cluster-yes",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=60,
        )
        wait_until(cluster.healthy, "cluster_state:ok with every replica in sync", timeout=60)
        yield cluster
    finally:
        for node in nodes:
            if node.process is not None and node.alive:
                stop_process(node.process)
