"""Real servers for tests: free ports, a real redis-server, waiting for readiness."""

from __future__ import annotations

import asyncio
import inspect
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from services.process.ports import listen_port

CHECKOUT = Path(__file__).resolve().parents[2]


def pythonpath(root: Path = CHECKOUT) -> str:
    """The PYTHONPATH that runs a checkout's own code in a child process: its root (the
    ``services`` package) and the SDK's folder (``gtr_client`` and the generated
    ``retrieval``), before whatever the venv has installed."""
    return os.pathsep.join([str(root), str(root / "clients" / "python")])


_GIVEN: set[int] = set()  # the ports free_port handed out in this process


def free_port() -> int:
    """A port free now, and never one this process was given before: the kernel may hand
    back a port just released, so two calls for one server's ports could name the same
    (a CI run's Triton got its HTTP and metrics ports equal and refused to start)."""
    while True:
        port = listen_port()  # below the ephemeral range: no connection's local port
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


def wait_until(
    condition: Callable[[], bool], what: str, timeout: float = 10.0, interval: float = 0.05
) -> None:
    """Poll ``condition`` until it holds (AssertionError naming ``what`` after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f} s: {what}")
        time.sleep(interval)


async def await_until(
    condition: Callable[[], bool | Awaitable[bool]],
    what: str,
    timeout: float = 10.0,
    interval: float = 0.05,
) -> float:
    """:func:`wait_until` for a test's event loop: poll ``condition`` (a function, or a
    coroutine function) without blocking the loop until it holds; the seconds it took
    (AssertionError naming ``what`` after ``timeout``)."""
    start = time.monotonic()
    while True:
        held = condition()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout:.0f} s: {what}")
        await asyncio.sleep(interval)


def wait_for_port(port: int, timeout: float = 30.0, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout:.0f} s")


@dataclass
class RedisServer:
    port: int
    data_dir: Path
    process: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


def redis_binary() -> str | None:
    return shutil.which("redis-server") or (
        "/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists() else None
    )


def start_redis(
    data_dir: Path, port: int, fsync: str = "always", extra: Sequence[str] = ()
) -> subprocess.Popen[bytes]:
    """A real redis-server with AOF on (``appendfsync`` ``fsync``) on ``port``, once it
    listens; ``extra``: more of its flags (``--replicaof host port`` for a replica).

    Started again with the same ``data_dir`` and port, it reloads its AOF: a restart."""
    binary = redis_binary()
    if binary is None:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
    data_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(data_dir),
            "--appendonly",
            "yes",
            "--appendfsync",
            fsync,
            "--save",
            "",
            "--daemonize",
            "no",
            "--protected-mode",
            "no",
            "--loglevel",
            "warning",
            *extra,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port, 20)
    except TimeoutError:
        proc.kill()
        raise
    return proc


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout)


@contextmanager
def run_redis(data_dir: Path) -> Iterator[RedisServer]:
    """A real redis-server with AOF on (appendfsync always), on a free port."""
    port = free_port()
    proc = start_redis(data_dir, port)
    try:
        yield RedisServer(port=port, data_dir=data_dir, process=proc)
    finally:
        stop_process(proc)


@dataclass
class RestartableRedis(RedisServer):
    """A real redis-server that a test kills (``kill -9``) and starts again on the same
    port with the same AOF directory."""

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def start(self) -> None:
        self.process = start_redis(self.data_dir, self.port)
