"""Child processes of the local stack: start, wait until healthy, stop in order."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def grpc_healthy(address: str, timeout: float = 1.0) -> bool:
    """True when the gRPC health service at ``address`` answers SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout
            )
            return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
    except grpc.RpcError:
        return False


class ChildFailed(RuntimeError):
    """A child exited or never became healthy; the message carries its log tail."""


@dataclass
class Child:
    name: str
    argv: Sequence[str]
    log_path: Path
    env: Mapping[str, str] = field(default_factory=dict)
    address: str = ""
    metrics: str = ""  # host:port of its Prometheus endpoint, if it has one
    job: str = ""  # Prometheus job label (gateway, index, rerank, triton)
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        fh = self.log_path.open("ab")
        env = {**os.environ, **self.env}
        self.process = subprocess.Popen(
            list(self.argv),
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # Ctrl-C reaches the launcher only; it stops us in order
        )
        fh.close()
        log.debug("started %s (pid %s): %s", self.name, self.process.pid, " ".join(self.argv))

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(self, ready: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise ChildFailed(
                    f"{self.name} exited with {self.process.returncode if self.process else '?'}"
                    f"; last lines of {self.log_path}:\n{self.log_tail()}"
                )
            if ready():
                return
            time.sleep(0.2)
        raise ChildFailed(
            f"{self.name} not ready after {timeout:.0f} s; last lines of {self.log_path}:\n"
            f"{self.log_tail()}"
        )

    def stop(self, grace: float = 10.0) -> None:
        proc = self.process
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop within %.0f s: killing it", self.name, grace)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


@dataclass
class Supervisor:
    """Owns the children; stops them in reverse start order."""

    children: list[Child] = field(default_factory=list)

    def start(self, child: Child, ready: Callable[[], bool], timeout: float) -> Child:
        self.children.append(child)
        child.start()
        child.wait_ready(ready, timeout)
        return child

    def first_dead(self) -> Child | None:
        return next((c for c in self.children if not c.alive()), None)

    def stop_all(self) -> None:
        for child in reversed(self.children):
            child.stop()
