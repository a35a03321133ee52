"""Where a benchmark's CPU goes: the cores each process role of a local stack used in a
window (``bench.rollout``'s ``cpu_cores``: before the rollout and during it).

A process of its own (spawned, like the rollout bench's phase watcher: reading ``/proc``
from a thread of the load generator would take the GIL from its event loop) lists every
descendant of the bench's process once a second and reads each one's CPU time
(``utime + stime`` of ``/proc/<pid>/stat``, every thread included) and the machine's busy
time (``/proc/stat``: all but idle and iowait). A window's figure is CPU seconds ÷ wall
seconds, i.e. cores; a process that ended within a window loses its last second.

Roles, from each process's command line: ``client`` (the bench's own processes),
``builder`` (``index rollout``), ``gateway``, ``shards <generation>``, ``triton``,
``stub <model>/<version>`` (a Triton Python backend stub: the serving version and a
rollout's new one apart), ``redis``, ``up``, else the program's name. The shards that
``up`` forks (since 2026-11-30) carry their fork server's command line: they are named
from ``up``'s ``stack.json`` when the sampler is given it (``stack_file``), else
``shards`` (until 2026-12-02 they were counted as ``client``). ``machine`` is the
whole machine's busy cores and ``other`` what the rest of it used meanwhile (another job's
load: a figure read beside one is not a quiet machine's).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import time
from pathlib import Path
from typing import Any

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
EVERY_S = 1.0


def read_stat(path: str) -> tuple[str, int, float] | None:
    """(name, parent pid, CPU seconds) of a ``/proc/<pid>/stat`` or
    ``/proc/<pid>/task/<tid>/stat`` file; None when it is gone."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    name = raw[raw.index(b"(") + 1 : raw.rfind(b")")].decode(errors="replace")
    fields = raw[raw.rfind(b")") + 2 :].split()  # comm may hold spaces and parentheses
    return name, int(fields[1]), (int(fields[11]) + int(fields[12])) * TICK_S


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of ``pid``; None when it is gone."""
    stat = read_stat(f"/proc/{pid}/stat")
    return None if stat is None else (stat[1], stat[2])


def machine_busy_s() -> float:
    """CPU seconds the machine's CPUs have been busy (all but idle and iowait) since boot."""
    with open("/proc/stat") as fh:
        cpu = [int(x) for x in fh.readline().split()[1:]]
    return (sum(cpu[:8]) - cpu[3] - cpu[4]) * TICK_S  # user..steal, minus idle and iowait


def machine_steal_s() -> float:
    """CPU seconds the hypervisor gave this VM's CPUs to others while they had work
    (``steal`` in /proc/stat) since boot: counted in :func:`machine_busy_s` too."""
    with open("/proc/stat") as fh:
        cpu = [int(x) for x in fh.readline().split()[1:]]
    return cpu[7] * TICK_S if len(cpu) > 7 else 0.0


def role(pid: int, root: int, named: dict[int, str] | None = None) -> str:
    """The role of ``pid``, a descendant of the bench's process ``root``; ``named``: the
    local stack's children by pid (:func:`stack_children`), which name the shards that
    ``up`` forks (their command line is the fork server's)."""
    if pid == root:
        return "client"
    if named and pid in named:
        return _named_role(named[pid])
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            argv = [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
    except OSError:
        return "gone"
    if not argv:
        return "gone"
    line = " ".join(argv)
    if argv[0].endswith("triton_python_backend_stub") and len(argv) > 1:
        version = os.path.dirname(argv[1])
        return f"stub {os.path.basename(os.path.dirname(version))}/{os.path.basename(version)}"
    for marker, name in (
        ("multiprocessing.forkserver", "shards"),  # up's fork server, or a shard unnamed
        (" index rollout", "builder"),
        (" gateway serve", "gateway"),
        (" up ", "up"),
        ("multiprocessing", "client"),
    ):
        if marker in line:
            return name
    if " index serve" in line:
        generation = argv[argv.index("--generation") + 1] if "--generation" in argv else "g1"
        return f"shards {generation}"
    return os.path.basename(argv[0]).split(" ")[0]  # redis-server rewrites its argv


def _named_role(name: str) -> str:
    """A stack child's role from its name: ``g3-shard-0-replica-0`` is ``shards g3``,
    ``shard-0-replica-0`` (the first generation's) ``shards g1``, others their name."""
    match = re.fullmatch(r"(?:(g\d+)-)?shard-\d+-replica-\d+", name)
    if match:
        return f"shards {match.group(1) or 'g1'}"
    return name


def stack_children(stack_file: str | None) -> dict[int, str]:
    """The local stack's children by pid, from ``up``'s ``stack.json`` ({} without one)."""
    if not stack_file:
        return {}
    try:
        with open(stack_file, encoding="utf-8") as fh:
            children = json.load(fh).get("children", [])
    except (OSError, ValueError):  # not written yet, or being rewritten
        return {}
    return {int(c["pid"]): str(c["name"]) for c in children if c.get("pid")}


def sample(root: int, named: dict[int, str] | None = None) -> dict[str, float]:
    """CPU seconds so far by role over ``root``'s descendants (``root`` included), the
    machine's busy seconds as ``machine`` and the hypervisor's steal as ``steal``;
    ``named``: the stack's children by pid (:func:`role`)."""
    parents: dict[int, tuple[int, float]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (stat := _stat(int(name))) is not None:
            parents[int(name)] = stat
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in parents.items():
        children.setdefault(ppid, []).append(pid)
    out: dict[str, float] = {"machine": machine_busy_s(), "steal": machine_steal_s()}
    todo = [root]
    while todo:
        pid = todo.pop()
        if pid in parents:
            key = role(pid, root, named)
            out[key] = out.get(key, 0.0) + parents[pid][1]
        todo.extend(children.get(pid, []))
    return out


def _sample_loop(
    root: int,
    stop: Any,
    out: Any,
    every_s: float = EVERY_S,
    stack_file: str | None = None,
    ready: Any = None,
) -> None:
    """Sample until ``stop`` is set or the parent is gone. SIGINT and SIGTERM are the
    parent's to handle: `timeout` signals the whole process group, and a sampler killed
    while it waits on ``stop`` left the parent's ``stop.set()`` waiting for it forever
    (a bench under `timeout` then never ended)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = os.getppid()
    samples: list[tuple[float, dict[str, float]]] = []
    while not stop.is_set() and os.getppid() == parent:
        named = stack_children(stack_file)
        # CLOCK_MONOTONIC, the clock every process of the bench reads its times on
        samples.append((time.monotonic(), sample(root, named)))
        if ready is not None:
            ready.set()
        stop.wait(every_s)
    out.put(samples)


def cores(
    samples: list[tuple[float, dict[str, float]]], start: float, end: float
) -> dict[str, float]:
    """Cores used by role from ``start`` to ``end`` (monotonic seconds): the samples
    nearest inside the window; a role's CPU that went down (a process ended) counts 0."""
    inside = [s for s in samples if start <= s[0] <= end]
    if len(inside) < 2:
        return {}
    (t0, first), (t1, last) = inside[0], inside[-1]
    used = {key: max(0.0, last[key] - first.get(key, 0.0)) / (t1 - t0) for key in sorted(last)}
    return {key: round(value, 3) for key, value in with_other(used).items()}


def _at(samples: list[tuple[float, dict[str, float]]], t: float) -> dict[str, float] | None:
    """Each role's CPU seconds at ``t``, linear between the samples either side; None
    outside the samples."""
    for (t0, a), (t1, b) in itertools.pairwise(samples):
        if t0 <= t <= t1:
            w = (t - t0) / (t1 - t0) if t1 > t0 else 0.0
            return {k: a.get(k, 0.0) + w * (b[k] - a.get(k, 0.0)) for k in b}
    return None


def seconds_used(
    samples: list[tuple[float, dict[str, float]]], start: float, end: float
) -> dict[str, float]:
    """CPU seconds by role from ``start`` to ``end`` (monotonic seconds), each end read
    between the samples around it, so a window shorter than the sampling interval still
    gets its share (the rounds' segments, summed over rounds): {} outside the samples;
    a role whose CPU went down (a process ended) counts 0."""
    first, last = _at(samples, start), _at(samples, end)
    if first is None or last is None:
        return {}
    return {k: max(0.0, v - first.get(k, 0.0)) for k, v in last.items()}


MACHINE_KEYS = ("machine", "steal")  # not processes: the whole machine's figures


def with_other(used: dict[str, float]) -> dict[str, float]:
    """``used`` (cores or seconds by role) with ``other``: what the rest of the machine
    used meanwhile (another job's load, read beside ours), the hypervisor's steal apart."""
    ours = sum(v for k, v in used.items() if k not in MACHINE_KEYS)
    other = used.get("machine", 0.0) - used.get("steal", 0.0) - ours
    return {**used, "other": max(0.0, other)}


def timeline(
    samples: list[tuple[float, dict[str, float]]],
    origin: float,
    bucket_s: float = 2.0,
    least: float = 0.1,
) -> str:
    """Cores by role in each ``bucket_s`` from ``origin`` (monotonic seconds, the load's
    start, so the rows line up with the searches' timeline): the machine's busy cores,
    the steal, then every role that used at least ``least`` of a core, most first. Where
    a phase change's slow searches come from (which process woke up)."""
    rows = []
    t = origin
    end = samples[-1][0] if samples else origin
    while t < end:
        used = cores(samples, t, t + bucket_s)
        if used:
            roles = sorted(
                ((k, v) for k, v in used.items() if k not in MACHINE_KEYS and v >= least),
                key=lambda kv: -kv[1],
            )
            rows.append(
                f"{t - origin:6.0f}s machine {used.get('machine', 0.0):4.2f} steal "
                f"{used.get('steal', 0.0):4.2f}: " + ", ".join(f"{k} {v:.2f}" for k, v in roles)
            )
        t += bucket_s
    return "\n".join(rows)


class RoleCpu:
    """``with RoleCpu(os.getpid()) as cpu: ...`` then ``cpu.cores(start, end)``."""

    def __init__(self, root: int, every_s: float = EVERY_S, stack_file: Path | None = None) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self._stop = ctx.Event()
        self._out: Any = ctx.Queue()
        self._ready = ctx.Event()  # set once it has its first sample
        stack = str(stack_file) if stack_file else None
        args = (root, self._stop, self._out, every_s, stack, self._ready)
        self._proc = ctx.Process(target=_sample_loop, args=args)
        self.samples: list[tuple[float, dict[str, float]]] = []

    def __enter__(self) -> RoleCpu:
        """Started, with its first sample taken (a window from now on has both ends)."""
        self._proc.start()
        self._ready.wait(30)
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._proc.is_alive():  # killed: setting the event would wait for it
            return
        self._stop.set()
        self.samples = self._out.get(timeout=30)
        self._proc.join(10)

    def cores(self, start: float, end: float) -> dict[str, float]:
        return cores(self.samples, start, end)

    def timeline(self, origin: float, bucket_s: float = 2.0) -> str:
        return timeline(self.samples, origin, bucket_s)
