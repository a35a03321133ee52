"""A rollout's processes paused while searches run (``gateway serve --hold-file``; design and
measurements: docs/generations.md "A rollout pauses while searches run").

On the local stack a rollout shares the machine's cores with serving. Where a busy second
core costs the searches by itself (a guest whose host takes both vCPUs' time away when
both run; docs/generations.md "The host, when both vCPUs run"), no scheduling weight
helps: the rollout's processes have to be *off* the CPUs while a search runs. So:

- ``up`` lists, on every pass of its generations poller, the processes of a running
  rollout that may be paused: the target's shards and the new encoder's Triton stub
  (while a CPU budget holds them, until the hand-over), and the rollout's CLI when it
  runs on this machine, leads its own session (a process in a terminal's session is
  left alone: its shell would report it stopped) and runs ``index rollout`` or
  ``rollback`` (:func:`services.generations.placement.held`). Each as its pid and start time
  (``/proc/<pid>/stat`` field 22), in a file of the run directory (:func:`write`).
- The gateway (:class:`Holder`) re-reads the file when it changed, as its first search in
  flight begins, and stops those processes (``SIGSTOP``); as its last search in flight
  ends it continues them (``SIGCONT``). A hold lasts at most ``max_hold_s``: under
  searches that overlap without a gap the rollout runs anyway, as it would without a hold,
  and is never starved.
- Signals go through a pidfd opened once per process and checked against the recorded
  start time, so a pid the kernel gave to another process is never signalled.
- Nothing stays stopped: the gateway continues what it holds when it closes and, as it
  starts, every process listed (a gateway killed while holding); ``up`` continues every
  process that leaves the list and, at its start, every one listed. A process the hold
  cannot open is skipped, not waited for.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from services.process import cpus as cpu_sets

log = logging.getLogger(__name__)

# The longest a hold lasts (s): the longest a search that runs on and on keeps the rollout
# off the CPUs; a search's p99 on the local stack is tens of ms.
MAX_HOLD_S = 0.25


def write(path: Path, pids: Iterable[int]) -> dict[int, int]:
    """List ``pids`` (the living ones, with their start times) in ``path`` for the gateway's
    :class:`Holder`, replacing the file at once (a reader sees the old list or the new);
    the list written, pid → start time."""
    listed = {pid: t for pid in sorted(set(pids)) if (t := cpu_sets.start_ticks(pid)) is not None}
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump({"processes": [[pid, t] for pid, t in listed.items()]}, fh)
    os.replace(tmp, path)
    return listed


def read(path: Path) -> dict[int, int]:
    """The list in ``path``: pid → start time ({} when there is no file or it is unreadable)."""
    try:
        raw = json.loads(path.read_text())
        return {int(pid): int(t) for pid, t in raw.get("processes", [])}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


def resume(listed: dict[int, int]) -> None:
    """Continue the processes ``listed`` (pid → start time) that still run (``SIGCONT``: a
    no-op for a running process); a pid given to another process since is left alone."""
    for pid, started in listed.items():
        if cpu_sets.start_ticks(pid) == started:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGCONT)


# the file's name in the local stack's run directory
HOLD_FILE = "rollout-hold.json"

# "0" lists nothing: a rollout with a CPU budget is never paused (read by `up`; the
# benches measure with and without)
HOLD_ENV = "GTR_ROLLOUT_HOLD"


def hold_enabled() -> bool:
    return os.environ.get(HOLD_ENV, "1") != "0"


@dataclass
class HoldList:
    """``up``'s side: the file the gateway's :class:`Holder` reads, rewritten when the
    rollout's processes change; a process that leaves it is continued (the gateway may
    have held it last)."""

    path: Path
    listed: dict[int, int] = field(default_factory=dict)
    # the pids last asked for: a pass that names the same ones rewrites nothing, also
    # when one of them died meanwhile (the list written left it out)
    asked: frozenset[int] = frozenset()

    def start(self) -> None:
        """At ``up``'s start: continue whatever a previous run's file lists (a gateway
        killed while holding), then list nothing."""
        resume(read(self.path))
        self.listed, self.asked = write(self.path, ()), frozenset()

    def update(self, pids: Iterable[int]) -> None:
        wanted = frozenset(pids)
        if wanted == self.asked:
            return
        self.asked = wanted
        before = self.listed
        self.listed = write(self.path, wanted)
        resume({p: t for p, t in before.items() if self.listed.get(p) != t})


@dataclass
class Holder:
    """The gateway's side: :meth:`searching` around each search; the processes listed in
    ``path`` stopped while at least one runs, for at most ``max_hold_s`` at a time."""

    path: Path
    max_hold_s: float = MAX_HOLD_S
    # told each hold's seconds as it ends (the gateway's metrics); None: nobody
    on_release: Callable[[float], None] | None = None
    in_flight: int = 0
    holds: int = 0  # holds begun
    held_s: float = 0.0  # seconds held, summed
    _stamp: tuple[int, int, int] | None = None  # the file's (inode, mtime_ns, size) last read
    _fds: dict[int, int] = field(default_factory=dict)  # pid → pidfd
    _since: float | None = None  # monotonic start of the hold in force
    _timer: asyncio.TimerHandle | None = None  # ends the hold at max_hold_s

    @classmethod
    def opened(
        cls,
        path: Path,
        max_hold_s: float = MAX_HOLD_S,
        on_release: Callable[[float], None] | None = None,
    ) -> Holder:
        """A gateway's holder as it starts: whatever the list names is continued first (a
        gateway killed while holding leaves them stopped; its restart has no search in
        flight)."""
        resume(read(path))
        return cls(path, max_hold_s, on_release)

    @contextlib.contextmanager
    def searching(self) -> Iterator[None]:
        self.in_flight += 1
        if self.in_flight == 1:
            self._hold()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._release()

    def close(self) -> None:
        """Continue whatever is held and close every pidfd."""
        self._release()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._stamp = None

    def _hold(self) -> None:
        self._refresh()
        if not self._fds:
            return
        self._signal(signal.SIGSTOP)
        self._since = time.monotonic()
        self.holds += 1
        with contextlib.suppress(RuntimeError):  # no running loop: held until the search ends
            self._timer = asyncio.get_running_loop().call_later(self.max_hold_s, self._release)

    def _release(self) -> None:
        if self._since is None:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._signal(signal.SIGCONT)
        held = time.monotonic() - self._since
        self.held_s += held
        self._since = None
        if self.on_release is not None:
            self.on_release(held)

    def _signal(self, sig: int) -> None:
        for pid, fd in list(self._fds.items()):
            try:
                signal.pidfd_send_signal(fd, sig)
            except ProcessLookupError:  # it ended: forget it
                os.close(self._fds.pop(pid))
            except OSError as exc:
                log.warning("hold: cannot signal %d (%s): left alone", pid, exc)
                os.close(self._fds.pop(pid))

    def _refresh(self) -> None:
        """Re-read the list when the file changed: pidfds for the new processes, the ones
        no longer listed forgotten."""
        try:
            st = os.stat(self.path)
            stamp: tuple[int, int, int] | None = (st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError:
            stamp = None
        if stamp == self._stamp:
            return
        self._stamp = stamp
        listed = read(self.path) if stamp is not None else {}
        for pid in [p for p in self._fds if p not in listed]:
            os.close(self._fds.pop(pid))
        for pid, started in listed.items():
            if pid in self._fds or pid == os.getpid():
                continue
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                continue  # gone (or not ours to signal)
            if cpu_sets.start_ticks(pid) != started:  # the pid is another process's now
                os.close(fd)
                continue
            self._fds[pid] = fd
