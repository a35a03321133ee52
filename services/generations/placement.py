"""The local stack's side of a rollout's CPU budget (``index rollout --cpus``; design and
measurements: docs/generations.md "A rollout's CPU budget").

On a machine whose cores serve searches, a rollout at full speed delays them: not for
want of CPU time but of an idle core to wake up on (a woken thread waits for a busy core
up to a scheduler tick, whatever the priorities). So a rollout given ``--cpus C`` gets
those CPUs and serving the others, for as long as the budget is recorded
(:data:`~services.index.keys.CPU_BUDGET_KEY`, kept alive by the rollout's CLI):

- **rollout**: the rollout target's shards (named by ``{gtr}:rollout``) and every Triton
  backend stub whose model version folder holds a budget file (the version the rollout
  published with ``--cpus``; the stub pins itself at load, this keeps it there); the
  builder pins itself. The rollout records the budget once its publish is done; until
  then (at most :data:`PUBLISH_GRACE_S`) a stub with a budget file is left where it
  pinned itself;
- **serving**: every other child of the stack (Redis, Triton, the gateway, the serving
  and previous generations' shards, Prometheus) and the other stubs: every CPU but C.

**Serving's load decides.** Keeping serving off the budget's CPUs helps only while what
is left holds serving's load: on 2 cores with writes at 20/s (each one encoded, twice
during a dual write), serving needed ~1.4 cores, and confined to one it queued for
seconds (search p99 118 ms → 2.7 s, 22.9x, against 6.9x with no budget at all;
docs/generations.md "Serving's load decides the split"). So the stack measures serving's
CPU use over the last :data:`LOAD_WINDOW_S` (:class:`ServingLoad`, from ``/proc``, on
every pass, with or without a budget) and splits the CPUs only while serving used at
most :data:`SPLIT_UP_TO` of the CPUs a budget leaves it; past that serving gets every CPU
back (the rollout keeps to its budget), and a split resumes once serving's use fell to
:data:`SPLIT_AGAIN_BELOW` of them (:func:`split`: the gap keeps it from flapping).

**The hand-over.** Once the rollout reaches its switch phase (:data:`HANDED_OVER`) its
target is about to serve: its shards and its stub go to serving's CPUs, and each pass
records in :data:`~services.index.keys.CPU_PLACED_KEY` which generation the budget still
holds; the builder closes the writes and moves the alias only once that no longer names
its target (at most a poller pass later). Without the hand-over the new serving
generation's first searches shared the budget's CPU with the builder's end (76 ms p99
against 27 ms, docs/generations.md "The switch phase, traced").

**The end.** The rollout's CLI marks the budget ending with its pid when the rollout is
over (:mod:`services.generations.budget`); the budget holds until that process has
exited, so its end stays on the budget's CPUs.

Without a budget every process may use every CPU again (the stubs widen their ONNX
Runtime thread pools to match). Applied on each pass of the generations poller, thread
by thread, to the threads whose affinity differs (a no-op when nothing changed).
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from services.common.errors import InvalidArgument
from services.generations.budget import parse as budget_value
from services.generations.state import RolloutState
from services.index.keys import CPU_BUDGET_KEY
from services.process import cpus as cpu_sets

log = logging.getLogger(__name__)


# How long a stub's budget file counts without a recorded budget: a publish's export and
# load, before the rollout records its budget (an older file is a killed rollout's).
PUBLISH_GRACE_S = 600.0


# The rollout phases in which the target's processes are serving's (on serving's CPUs).
HANDED_OVER = frozenset({"switch", "done"})
# How long the stack's record of its placement outlives its last pass (the poller runs
# every 0.5 s): a stack that stopped leaves no record the builder would wait on.
PLACED_TTL_S = 3


# Serving's measured use (cores), as a share of the CPUs a budget leaves it, up to which
# it is kept off the budget's CPUs, and below which a split that was lifted resumes.
SPLIT_UP_TO = 0.5
SPLIT_AGAIN_BELOW = 0.35
# the window serving's use is measured over (the poller samples every pass, 0.5 s)
LOAD_WINDOW_S = 5.0


class ServingLoad:
    """Serving's CPU use in cores over the last ``window_s``: :meth:`add` a sample of its
    processes on each pass, :meth:`cores` reads it (None until a window's worth of second
    is there). A process's first sample is its baseline; one that ended stops counting."""

    def __init__(
        self,
        window_s: float = LOAD_WINDOW_S,
        read: Callable[[int], float | None] = cpu_sets.cpu_seconds,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.window_s = window_s
        self._read = read
        self._clock = clock
        self._last: dict[int, float] = {}
        self._steps: deque[tuple[float, float]] = deque()  # (when, CPU s since the last)
        self._since = clock()

    def add(self, pids: Iterable[int]) -> None:
        now, used, seen = self._clock(), 0.0, {}
        for pid in pids:
            cpu = self._read(pid)
            if cpu is None:
                continue
            used += max(0.0, cpu - self._last.get(pid, cpu))
            seen[pid] = cpu
        self._last = seen
        self._steps.append((now, used))
        while self._steps and self._steps[0][0] <= now - self.window_s:
            self._since = self._steps.popleft()[0]

    def cores(self) -> float | None:
        if not self._steps:
            return None
        span = self._steps[-1][0] - self._since
        if span < min(1.0, self.window_s):
            return None
        return sum(used for _, used in self._steps) / span


def split(previous: bool, cores: float | None, kept: int) -> bool:
    """Whether serving keeps to the ``kept`` CPUs a budget leaves it, given its measured
    use (``cores``; None: not measured yet, keep ``previous``) and whether it did on the
    pass before (``previous``)."""
    if cores is None:
        return previous
    return cores <= (SPLIT_UP_TO if previous else SPLIT_AGAIN_BELOW) * kept


@dataclass(frozen=True)
class Process:
    pid: int
    rollout: bool  # a rollout's process (else serving)


def placement(
    processes: Iterable[Process],
    machine: frozenset[int],
    budget: frozenset[int] | None,
    split_cpus: bool = True,
) -> dict[int, frozenset[int]]:
    """pid → the CPUs it may use: without a budget every process gets ``machine``; with one,
    the rollout's processes get the budget and the others the rest (all of ``machine``
    when the budget would leave serving nothing, or when ``split_cpus`` is False: serving's
    load needs more than the rest, :func:`split`)."""
    mine = (budget or frozenset()) & machine
    if not mine or mine == machine:
        return {p.pid: machine for p in processes}
    serving = machine - mine if split_cpus else machine
    return {p.pid: mine if p.rollout else serving for p in processes}


def stub_budget_age(pid: int) -> float | None:
    """The age (s) of the budget file of the model version of ``pid``, a Triton Python
    backend stub (argv ``triton_python_backend_stub <version dir>/model.py ...``; the file
    is :func:`~services.process.cpus.budget_path`); None when it has none (or ``pid`` is
    no stub)."""
    argv = cpu_sets.cmdline(pid)
    if len(argv) < 2 or not argv[0].endswith("triton_python_backend_stub"):
        return None
    try:
        written = os.stat(cpu_sets.budget_path(os.path.dirname(argv[1])))
    except OSError:
        return None
    return max(0.0, time.time() - written.st_mtime)


def active_budget(raw: bytes | str | None, machine: frozenset[int]) -> frozenset[int] | None:
    """The running rollout's CPU budget on a machine of CPUs ``machine``, from the budget
    key's value ``raw``: None when there is none, when its rollout ended and its process
    has exited, or when it would leave serving nothing here."""
    if not raw:
        return None
    value = raw.decode() if isinstance(raw, bytes) else raw
    try:
        budget, exiting = budget_value(value)
    except InvalidArgument:
        log.warning("%s holds %r, not a CPU list: ignored", CPU_BUDGET_KEY, raw)
        return None
    if exiting is not None and not cpu_sets.running(exiting):
        return None  # the rollout ended and its process has exited
    mine = budget & machine
    return mine if mine and mine != machine else None


def budgeted_target(running: RolloutState | None) -> str:
    """The generation whose processes a CPU budget holds: the rollout's target until its
    switch phase (:data:`HANDED_OVER`), when they go to serving's CPUs; "" none."""
    if running is None or running.phase in HANDED_OVER:
        return ""
    return running.target


def apply(placed: dict[int, frozenset[int]]) -> int:
    """Pin each process (all its threads) to its CPUs; threads changed."""
    return sum(cpu_sets.pin_process(pid, cpus) for pid, cpus in placed.items())
