"""Child processes of the local stack: start, wait until healthy, supervise, stop in order.

Supervision: a :class:`Supervisor` watches every child it started. A child that exits
(crash, OOM kill, ``kill -9``) is restarted with the same argv, so on the same port and
with the same data directory: the gateway's gRPC channels reconnect to a restarted shard,
and a restarted Redis reloads its AOF. Restarts back off (``backoff_s`` doubled per
recent failure, up to ``backoff_max_s``); a restarted child is waited for until its
readiness probe passes in a thread of its own, so the other children stay supervised
meanwhile. A child that fails more than ``max_restarts`` times within ``window_s``
seconds (it exited, or did not become healthy again in time) is not restarted again:
the supervisor says so, stops every child and calls ``on_give_up`` (a child that is not
``essential``, a shard of a generation that does not serve, is only given up on: left
stopped while the rest serves on). :meth:`Supervisor.remove` stops children for good (the
shards of a retired generation). Every exit and
restart is logged, reported (the ``report`` callback: ``gtr-retrieval up`` prints it)
and counted (:attr:`Child.restarts`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from services.process import priority
from services.process.cpus import pin_process
from services.process.ports import listen_port

if TYPE_CHECKING:
    from services.rpc.tls import ClientTLS

log = logging.getLogger(__name__)

STOP_GRACE_S = 10.0  # SIGTERM → SIGKILL; Triton's --exit-timeout-secs stays below it


def free_port(host: str = "127.0.0.1") -> int:
    """A port a child can listen on: free now, never an outgoing connection's
    (:func:`services.process.ports.listen_port`)."""
    return listen_port(host)


def grpc_healthy(address: str, timeout: float = 1.0, tls: ClientTLS | None = None) -> bool:
    """True when the gRPC health service at ``address`` answers SERVING (over TLS by
    ``tls``)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from services.rpc.tls import channel as tls_channel

    try:
        with tls_channel(address, tls) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout
            )
            return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
    except grpc.RpcError:
        return False


def describe_exit(returncode: int | None) -> str:
    """``exited with 3``, ``killed by SIGKILL``."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with {returncode}"


class ChildFailed(RuntimeError):
    """A child exited or never became healthy; the message carries its log tail."""


class State(Enum):
    NEW = "new"
    RUNNING = "running"  # healthy at its last start; watched for an exit
    RESTARTING = "restarting"  # backing off, or restarted and not healthy yet
    STOPPED = "stopped"


Ready = Callable[[], bool]


class ChildProcess(Protocol):
    """What the supervisor uses of a child's process: a :class:`subprocess.Popen`, or a
    shard forked by the stack's fork server (:class:`services.stack.forking.ForkedProcess`)."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


# Starts a child's process instead of an exec (argv, environment, log file, CPUs):
# the stack's fork server for shard processes (services/stack/forking.py)
Spawn = Callable[[Sequence[str], Mapping[str, str], Path, "frozenset[int] | None"], ChildProcess]


@dataclass
class Child:
    name: str
    argv: Sequence[str]
    log_path: Path
    env: Mapping[str, str] = field(default_factory=dict)
    address: str = ""
    metrics: str = ""  # host:port of its Prometheus endpoint, if it has one
    job: str = ""  # Prometheus job label (gateway, index, rerank, triton)
    process: ChildProcess | None = None
    ready: Ready | None = None  # the readiness probe (set by Supervisor.start)
    ready_timeout_s: float = 60.0
    restarts: int = 0
    state: State = State.NEW
    # essential: when it keeps failing the whole stack stops (``up`` exits 1); a child
    # that is not (a shard of a generation that does not serve) is only given up on:
    # stopped and left STOPPED, the rest of the stack serves on
    essential: bool = True
    # the CPUs it starts on (a rollout's CPU budget, services/generations/placement.py); None:
    # the launcher's
    cpus: frozenset[int] | None = None
    # how its process starts: None exec's ``argv``; the stack's fork server forks shards
    spawn: Spawn | None = None
    # its session's nice (services/process/priority.py): > 0 for a child whose work
    # waits behind the searches' when both want a CPU (Triton encoding only documents)
    nice: int = 0

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env}
        if self.spawn is not None:
            self.process = self.spawn(self.argv, env, self.log_path, self.cpus)
            log.debug("forked %s (pid %s): %s", self.name, self.process.pid, " ".join(self.argv))
            self._weigh()
            return
        fh = self.log_path.open("ab")
        self.process = subprocess.Popen(
            list(self.argv),
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # Ctrl-C reaches the launcher only; it stops us in order
        )
        fh.close()
        if self.cpus:  # before its interpreter starts threads: they inherit it
            pin_process(self.process.pid, self.cpus)
        log.debug("started %s (pid %s): %s", self.name, self.process.pid, " ".join(self.argv))
        self._weigh()

    def _weigh(self) -> None:
        """Its session at :attr:`nice` (it leads its session: its weight is its own)."""
        if not self.nice or self.process is None:
            return
        if not priority.settle_group_nice(self.process.pid, self.nice):
            log.warning(
                "%s: its session's nice stays 0, not %d (no autogroup here, or the kernel "
                "deferred it)",
                self.name,
                self.nice,
            )

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def note(self, line: str) -> None:
        """Append a line of ours to the child's log (where a restart happened, and why)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        with self.log_path.open("a", encoding="utf-8") as fh:
            fh.write(f"--- {stamp} supervisor: {line}\n")

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(
        self, ready: Ready, timeout: float, cancel: threading.Event | None = None
    ) -> None:
        """Return once ``ready()``; ChildFailed if it exits, times out or ``cancel`` is set."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cancel is not None and cancel.is_set():
                raise ChildFailed(f"{self.name}: wait cancelled")
            if not self.alive():
                code = self.process.returncode if self.process else None
                raise ChildFailed(
                    f"{self.name} {describe_exit(code)}; last lines of {self.log_path}:\n"
                    f"{self.log_tail()}"
                )
            if ready():
                return
            if cancel is not None:
                cancel.wait(0.2)
            else:
                time.sleep(0.2)
        raise ChildFailed(
            f"{self.name} not ready after {timeout:.0f} s; last lines of {self.log_path}:\n"
            f"{self.log_tail()}"
        )

    def stop(self, grace: float = STOP_GRACE_S) -> bool:
        """SIGTERM to the child's process group, SIGKILL after ``grace`` seconds.

        Returns True when it had to be killed (it did not stop on SIGTERM in time).
        """
        proc = self.process
        if proc is None or proc.poll() is not None:
            return False
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            proc.wait()
            return False
        try:
            proc.wait(grace)
            return False
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop within %.0f s: killing it", self.name, grace)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
            return True


@dataclass(frozen=True)
class RestartPolicy:
    """When an exited child is restarted, and when the supervisor gives up."""

    backoff_s: float = 0.5  # before the first restart; doubled per recent failure
    backoff_max_s: float = 15.0
    max_restarts: int = 5  # a child failing more often than this within window_s: give up
    window_s: float = 120.0
    poll_s: float = 0.2  # how often the children are checked

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.window_s <= 0 or self.backoff_s < 0:
            raise ValueError("max_restarts ≥ 0, window_s > 0 and backoff_s ≥ 0 are needed")

    def delay(self, recent_failures: int) -> float:
        return float(min(self.backoff_max_s, self.backoff_s * 2 ** max(0, recent_failures - 1)))


def _ignore(_message: str) -> None:
    return None


class Supervisor:
    """Owns the children: starts them, restarts the ones that exit, stops them in reverse
    start order (see the module docstring)."""

    def __init__(
        self,
        policy: RestartPolicy | None = None,
        *,
        report: Callable[[str], None] = _ignore,
        on_change: Callable[[], None] | None = None,
        on_give_up: Callable[[str], None] | None = None,
    ) -> None:
        self.policy = policy or RestartPolicy()
        self.children: list[Child] = []
        self.failure: str | None = None  # why it gave up
        self._report = report
        self._on_change = on_change
        self._on_give_up = on_give_up
        self._lock = threading.RLock()  # children's states, starts and stops
        self._stop_lock = threading.Lock()
        self._closing = threading.Event()
        self._failures: dict[str, deque[float]] = {}
        self._threads: list[threading.Thread] = []
        self._monitor: threading.Thread | None = None

    # --- start, stop ---------------------------------------------------------------

    def start(self, child: Child, ready: Ready, timeout: float) -> Child:
        """Start ``child`` and wait until ``ready()`` (ChildFailed if it does not get
        there); from then on it is supervised (once :meth:`watch` runs)."""
        self.launch(child, ready, timeout)
        return self.await_ready(child)

    def launch(self, child: Child, ready: Ready, timeout: float) -> Child:
        """Start ``child`` without waiting (:meth:`await_ready` waits): several children
        come up at once."""
        with self._lock:
            if self._closing.is_set():
                raise ChildFailed(f"{self.failure or 'stopping'}: not starting {child.name}")
            child.ready, child.ready_timeout_s = ready, timeout
            self.children.append(child)
            child.state = State.RESTARTING
            child.start()
        return child

    def await_ready(self, child: Child) -> Child:
        """Wait until a :meth:`launch`-ed child is ready; supervised from then on."""
        assert child.ready is not None
        child.wait_ready(child.ready, child.ready_timeout_s, cancel=self._closing)
        with self._lock:
            if child.state is State.RESTARTING:
                child.state = State.RUNNING
        return child

    def remove(self, children: Sequence[Child], grace: float = STOP_GRACE_S) -> list[str]:
        """Stop supervising ``children`` and stop them (a pending restart of one of them
        does not happen); the names of the ones that had to be killed."""
        with self._lock:
            gone = [c for c in children if c in self.children]
            self.children = [c for c in self.children if c not in gone]
            for child in gone:
                child.state = State.STOPPED
        killed = [c.name for c in gone if c.stop(grace)]
        self._changed()
        return killed

    def watch(self) -> None:
        """Supervise in a background thread from now on (idempotent)."""
        with self._lock:
            if self._monitor is None and not self._closing.is_set():
                self._monitor = threading.Thread(target=self._watch, name="supervisor", daemon=True)
                self._monitor.start()

    def stop_all(self, grace: float = STOP_GRACE_S) -> list[str]:
        """Stop supervising, then stop every child in reverse start order; the names of
        the ones that had to be killed (SIGKILL after ``grace`` seconds)."""
        with self._lock:  # a start in another thread is either listed below or refused
            self._closing.set()
        with self._stop_lock:
            me = threading.current_thread()
            for thread in [self._monitor, *self._threads]:
                if thread is not None and thread is not me:
                    thread.join()
            killed = []
            for child in reversed(self.children):
                if child.stop(grace):
                    killed.append(child.name)
                child.state = State.STOPPED
            return killed

    def first_dead(self) -> Child | None:
        return next((c for c in self.children if not c.alive()), None)

    def restart_counts(self) -> dict[str, int]:
        return {c.name: c.restarts for c in self.children}

    # --- supervision ---------------------------------------------------------------

    def _watch(self) -> None:
        while not self._closing.wait(self.policy.poll_s):
            if self.failure is not None:
                self._give_up()
                return
            with self._lock:
                exited = [c for c in self.children if c.state is State.RUNNING and not c.alive()]
            for child in exited:
                code = child.process.returncode if child.process else None
                self._failed(child, describe_exit(code))

    def _failed(self, child: Child, why: str) -> None:
        """Count a failure of ``child``; schedule its restart, or give up."""
        policy = self.policy
        now = time.monotonic()
        thread: threading.Thread | None = None
        with self._lock:
            if self._closing.is_set() or self.failure is not None:
                return
            if child not in self.children:  # removed meanwhile (its generation stopped)
                return
            recent = self._failures.setdefault(child.name, deque())
            recent.append(now)
            while recent and recent[0] < now - policy.window_s:
                recent.popleft()
            child.state = State.RESTARTING
            if len(recent) > policy.max_restarts and not child.essential:
                child.state = State.STOPPED
                message = (
                    f"{child.name} {why}; it failed {len(recent)} times within "
                    f"{policy.window_s:.0f} s (restarted {child.restarts} times): giving up "
                    "on it, the rest of the stack serves on"
                )
            elif len(recent) > policy.max_restarts:
                self.failure = (
                    f"{child.name} {why}; it failed {len(recent)} times within "
                    f"{policy.window_s:.0f} s (restarted {child.restarts} times): giving up"
                )
                message = f"{self.failure}; stopping everything"  # the monitor thread does
            else:
                delay = policy.delay(len(recent))
                message = (
                    f"{child.name} {why}; restart {child.restarts + 1} in {delay:.1f} s "
                    f"(log {child.log_path})"
                )
                thread = threading.Thread(
                    target=self._restart,
                    args=(child, delay),
                    name=f"restart-{child.name}",
                    daemon=True,
                )
                self._threads = [t for t in self._threads if t.is_alive()] + [thread]
                thread.start()
            child.note(message)
        log.log(logging.WARNING if thread else logging.ERROR, "%s", message)
        self._report(message)
        self._changed()

    def _restart(self, child: Child, delay: float) -> None:
        if self._closing.wait(delay):
            return
        with self._lock:
            if self._closing.is_set() or self.failure is not None:
                return
            if child not in self.children:  # removed while it waited
                return
            child.restarts += 1
            child.start()
        self._changed()
        started = time.monotonic()
        try:
            assert child.ready is not None
            child.wait_ready(child.ready, child.ready_timeout_s, cancel=self._closing)
        except ChildFailed:
            if self._closing.is_set():
                return
            if child.alive():
                why = f"not healthy {child.ready_timeout_s:.0f} s after restart {child.restarts}"
                child.stop(grace=2.0)
            else:
                code = child.process.returncode if child.process else None
                why = f"{describe_exit(code)} after restart {child.restarts}"
            self._failed(child, why)
            return
        with self._lock:
            if child.state is State.RESTARTING:
                child.state = State.RUNNING
        counts = ", ".join(f"{n} {k}" for n, k in self.restart_counts().items() if k)
        message = (
            f"{child.name} healthy again after {time.monotonic() - started:.1f} s "
            f"(pid {child.pid}); restarts so far: {counts}"
        )
        child.note(message)
        log.warning("%s", message)
        self._report(message)
        self._changed()

    def _give_up(self) -> None:
        message = self.failure or "giving up"
        self.stop_all()
        if self._on_give_up is not None:
            self._on_give_up(message)

    def _changed(self) -> None:
        if self._on_change is not None:
            try:
                self._on_change()
            except Exception:  # a report must not end supervision
                log.exception("on_change failed")


@contextlib.contextmanager
def sigterm_as_interrupt(first: Callable[[], None] | None = None) -> Iterator[None]:
    """Within: SIGTERM raises KeyboardInterrupt in the main thread, as Ctrl-C does, so the
    ``finally`` that stops the children runs. SIGTERM's default action ends a Python
    process at once, and children in sessions of their own (ours, :meth:`Child.start`)
    outlive it: a bench under ``timeout`` left its whole stack running (issue #33).
    ``first`` runs in the handler before the interrupt is raised: what a thread waits on
    is ended there (a thread cannot be interrupted, and ``asyncio.run`` waits for its
    executor's threads before the main thread's ``finally`` can run). Outside the main
    thread (where no handler can be set) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        if first is not None:
            first()
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
