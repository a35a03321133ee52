"""The local stack's side of a rollout's CPU budget (``index rollout --cpus``; design and
measurements: docs/generations.md "A rollout's CPU budget").

On a machine whose cores serve searches, a rollout at full speed delays them: not for
want of CPU time but of an idle core to wake up on (a woken thread waits for a busy core
up to a scheduler tick, whatever the priorities). So a rollout given ``--cpus C`` keeps
to those CPUs, leaving the others to serving, for as long as the budget is recorded
(:data:`~services.index.keys.CPU_BUDGET_KEY`, kept alive by the rollout's CLI):

- **rollout**: the rollout target's shards (named by ``{gtr}:rollout``) and every Triton
  backend stub whose model version folder holds a budget file (the version the rollout
  published with ``--cpus``; the stub pins itself at load, this keeps it there); the
  builder pins itself. The rollout records the budget once its publish is done; until
  then (at most :data:`PUBLISH_GRACE_S`) a stub with a budget file is left where it
  pinned itself;
- **serving**: every other child of the stack (Redis, Triton, the gateway, the serving
  and previous generations' shards, Prometheus) and the other stubs: every CPU.

**Serving keeps every CPU.** The budget confines the rollout, not serving: serving's
processes may run on every CPU, the budget's too, and the scheduler wakes them on the
CPUs the rollout leaves idle. Until 2026-12-01 serving was kept off the budget's CPUs
while its measured load fitted in half of the CPUs left (a *split*); on this 2-core
machine every measurement of it cost the searches more than it saved: a new encoder's
rollout with serving at ~0.55 of the one CPU left read 1.92x against ~1.45x, and eight
pooled ``--retrain`` rollouts with serving at ~0.45 of it read 1.64-2.02x, against
1.49-2.08x without the split (within that bench's spread; docs/generations.md "Serving
keeps every CPU"). Confined
to one CPU, every serving thread's wake-up queues behind the others'; what the budget
has to guarantee is only that the rollout's work stays off the other CPUs.

**The rollout yields.** The target's shards (each leads its session) also get the least
scheduling weight, their autogroups at nice 19 (:func:`weigh`,
:mod:`services.process.priority`), as the CLI gives itself: a serving thread woken on a
budget CPU takes it at once. A Triton stub shares Triton's session and is not weighed.

**The hand-over.** Once the rollout reaches its switch phase (:data:`HANDED_OVER`) its
target is about to serve: its shards go to every CPU and back to nice 0, its stub to
every CPU, and each pass
records in :data:`~services.index.keys.CPU_PLACED_KEY` which generation the budget still
holds (pinned, or yielding: a weight change the kernel deferred); the builder closes the
writes and moves the alias only once that no longer names its target (at most a poller
pass later). Without the hand-over the new serving
generation's first searches ran on the budget's CPU only, beside the builder's end (76
ms p99 against 27 ms, docs/generations.md "The switch phase, traced").

**The end.** The rollout's CLI deletes the budget when the rollout is over
(:mod:`services.generations.budget`); no process of the stack is on it by then, and the
CLI pinned itself.

Without a budget every process may use every CPU again (the stubs widen their ONNX
Runtime thread pools to match). Applied on each pass of the generations poller, thread
by thread, to the threads whose affinity differs (a no-op when nothing changed).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

from services.common.errors import InvalidArgument
from services.generations.budget import parse as budget_value
from services.generations.state import RolloutState
from services.index.keys import CPU_BUDGET_KEY
from services.process import cpus as cpu_sets
from services.process import priority

log = logging.getLogger(__name__)


# How long a stub's budget file counts without a recorded budget: a publish's export and
# load, before the rollout records its budget (an older file is a killed rollout's).
PUBLISH_GRACE_S = 600.0


# The rollout phases in which the target's processes are serving's (on serving's CPUs).
HANDED_OVER = frozenset({"switch", "done"})
# How long the stack's record of its placement outlives its last pass (the poller runs
# every 0.5 s): a stack that stopped leaves no record the builder would wait on.
PLACED_TTL_S = 3


@dataclass(frozen=True)
class Process:
    pid: int
    rollout: bool  # a rollout's process (else serving)


def placement(
    processes: Iterable[Process],
    machine: frozenset[int],
    budget: frozenset[int] | None,
) -> dict[int, frozenset[int]]:
    """pid → the CPUs it may use: the rollout's processes get the budget (every CPU
    without one, or when it would leave serving nothing), every other process every
    CPU of ``machine``."""
    mine = (budget or frozenset()) & machine
    if not mine or mine == machine:
        return {p.pid: machine for p in processes}
    return {p.pid: mine if p.rollout else machine for p in processes}


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
    key's value ``raw``: None when there is none, or when it would leave serving nothing
    here."""
    if not raw:
        return None
    value = raw.decode() if isinstance(raw, bytes) else raw
    try:
        budget = budget_value(value)
    except InvalidArgument:
        log.warning("%s holds %r, not a CPU list: ignored", CPU_BUDGET_KEY, raw)
        return None
    mine = budget & machine
    return mine if mine and mine != machine else None


def budgeted_target(running: RolloutState | None) -> str:
    """The generation whose processes a CPU budget holds: the rollout's target until its
    switch phase (:data:`HANDED_OVER`), when they go to serving's CPUs; "" none."""
    if running is None or running.phase in HANDED_OVER:
        return ""
    return running.target


def weigh(yielded: dict[int, str], wanted: dict[int, str]) -> dict[int, str]:
    """The rollout's processes ``wanted`` (pid → generation) at the least weight, the ones
    ``yielded`` before and no longer wanted back at nice 0 (:mod:`services.process.priority`):
    the processes yielding now. A change the kernel deferred is tried again on the next
    pass; only a process that leads its session is weighed (its autogroup is its own)."""
    out: dict[int, str] = {}
    for pid, name in wanted.items():
        if pid in yielded:
            out[pid] = yielded[pid]
        elif priority.leads_session(pid) and priority.set_group_nice(pid, priority.YIELD_NICE):
            out[pid] = name
    for pid, name in yielded.items():
        if pid not in wanted and priority.set_group_nice(pid, 0) is None:
            out[pid] = name  # deferred: still yielding, back on the next pass
    return out


def held(processes: Iterable[Process], running: RolloutState | None) -> list[int]:
    """The processes the gateway pauses while searches run (:mod:`services.process.hold`):
    the rollout's ones, and its CLI when it runs here, leads its own session (in a
    terminal's session its shell would report it stopped) and is an ``index rollout`` or
    ``index rollback`` (the recorded pid of a builder that died may name another process
    now)."""
    pids = [p.pid for p in processes if p.rollout]
    cli = running.pid if running is not None and running.runs_here else None
    if cli and cli not in pids and priority.leads_session(cli) and is_rollout_cli(cli):
        pids.append(cli)
    return pids


def is_rollout_cli(pid: int) -> bool:
    """Whether ``pid`` runs ``index rollout`` or ``index rollback`` (its command line)."""
    argv = cpu_sets.cmdline(pid)
    return any(
        word == "index" and argv[n + 1 : n + 2] in (["rollout"], ["rollback"])
        for n, word in enumerate(argv)
    )


def apply(placed: dict[int, frozenset[int]]) -> int:
    """Pin each process (all its threads) to its CPUs; threads changed."""
    return sum(cpu_sets.pin_process(pid, cpus) for pid, cpus in placed.items())
