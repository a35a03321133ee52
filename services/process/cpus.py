"""CPU sets: parse a ``taskset``-style list and pin a whole process to one (issue #24's
rollout CPU budget, docs/generations.md "A rollout's CPU budget").

Linux only (``sched_setaffinity``); elsewhere :func:`pin_process` does nothing and says so
by returning 0. A process is pinned thread by thread (``/proc/<pid>/task``): the affinity
of a process is per thread in Linux, and a thread created later inherits its creator's.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from services.common.errors import InvalidArgument

# The file that pins a Triton model version's backend stub to a CPU set (written by
# ``encoder publish --cpus`` for a rollout, read by the stub): see budget_path.
BUDGET_FILE = "cpu-budget"
# how many times :func:`pin_process` lists a process's threads at most
PIN_PASSES = 4


def budget_path(version_dir: str) -> str:
    """Where the CPU budget of the model version at ``version_dir`` (``<repo>/<model>/<n>``)
    is written: beside the model folders, ``<repo>/.<model>.<n>.cpu-budget`` (Triton
    takes a repository's files for no model). Not inside the version folder: a file
    written or removed there after Triton loaded the version changes the folder's time
    (Triton compares mtime and ctime), and Triton then reloads that version, by then the
    serving one, at the next load request (an ``encoder publish``). The stub's
    ``triton_models/embed_onnx.py`` says the same (it cannot import this)."""
    version = os.path.normpath(version_dir)
    model = os.path.dirname(version)
    return os.path.join(
        os.path.dirname(model),
        f".{os.path.basename(model)}.{os.path.basename(version)}.{BUDGET_FILE}",
    )


def available() -> frozenset[int]:
    """The CPUs this process may run on."""
    return frozenset(os.sched_getaffinity(0))


def machine() -> frozenset[int]:
    """The CPUs of this machine (or container): its cgroup's ``cpuset.cpus.effective``
    when there is one, else every online CPU. Not this process's affinity, which a
    parent may have narrowed."""
    for path in ("/sys/fs/cgroup/cpuset.cpus.effective", "/sys/devices/system/cpu/online"):
        try:
            with open(path) as fh:
                text = fh.read().strip()
            if text:
                return parse_cpus(text)
        except (OSError, InvalidArgument):
            continue
    return frozenset(range(os.cpu_count() or 1))


def parse_cpus(spec: str) -> frozenset[int]:
    """``"1"``, ``"2-3"``, ``"0,2-3"`` → the CPU numbers; InvalidArgument when malformed
    or empty."""
    cpus: set[int] = set()
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        first, _, last = part.partition("-")
        try:
            lo, hi = int(first), int(last or first)
        except ValueError:
            raise InvalidArgument(f"CPU list {spec!r}: {part!r} is not N or N-M") from None
        if lo < 0 or hi < lo:
            raise InvalidArgument(f"CPU list {spec!r}: {part!r} is not a range of CPU numbers")
        cpus.update(range(lo, hi + 1))
    if not cpus:
        raise InvalidArgument(f"CPU list {spec!r} names no CPU")
    return frozenset(cpus)


def format_cpus(cpus: Iterable[int]) -> str:
    """The inverse of :func:`parse_cpus` (ranges joined by commas)."""
    runs: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in runs)


def budget_for(spec: str, cpus_here: frozenset[int] | None = None) -> frozenset[int]:
    """A rollout's CPU budget from ``spec``: CPUs of this machine (``cpus_here``, default
    :func:`machine`), leaving at least one to serving; InvalidArgument otherwise."""
    cpus = parse_cpus(spec)
    mine = machine() if cpus_here is None else cpus_here
    if not cpus <= mine:
        raise InvalidArgument(
            f"--cpus {spec}: CPU(s) {format_cpus(cpus - mine)} are not on this machine "
            f"(it has {format_cpus(mine)})"
        )
    if cpus == mine:
        raise InvalidArgument(
            f"--cpus {spec} names every CPU this machine has ({format_cpus(mine)}): "
            "leave at least one to serving"
        )
    return cpus


def pin_process(pid: int, cpus: Iterable[int]) -> int:
    """Every thread of ``pid`` to ``cpus``; the number of threads changed (threads that
    end meanwhile are skipped; a process that is gone pins nothing). The threads are
    listed again until a pass changes none, so one started meanwhile by a thread not yet
    pinned is not left behind."""
    target = set(cpus)
    changed = 0
    for _ in range(PIN_PASSES):
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            return changed
        moved = 0
        for tid in tids:
            try:
                if os.sched_getaffinity(tid) != target:
                    os.sched_setaffinity(tid, target)
                    moved += 1
            except OSError:  # the thread ended, or a CPU went offline
                continue
        changed += moved
        if not moved:
            break
    return changed


def children_of(pid: int) -> list[int]:
    """The processes whose parent is ``pid``: from each of its threads'
    ``/proc/<pid>/task/<tid>/children`` (a child is listed under the thread that started
    it), else, on a kernel without them (``CONFIG_PROC_CHILDREN``), a scan of ``/proc``."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    out: list[int] = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as fh:
                out.extend(int(child) for child in fh.read().split())
        except FileNotFoundError:
            if not os.path.isdir(f"/proc/{pid}/task/{tid}"):
                continue  # the thread ended
            return _scan_children(pid)
        except OSError:
            continue
    return sorted(set(out))


def _scan_children(pid: int) -> list[int]:
    out: list[int] = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            out.append(int(name))
    return out


def stat_fields(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (``[0]`` is field 3, the
    state: ``proc(5)``'s field N is ``[N - 3]``); None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2 :].split()


def cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system, every thread) process ``pid`` has used; None when gone."""
    fields = stat_fields(pid)
    if fields is None:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def parent_pid(pid: int) -> int | None:
    """Process ``pid``'s parent; None when it is gone."""
    fields = stat_fields(pid)
    return None if fields is None else int(fields[1])


def start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/<pid>/stat`` field
    22): with the pid, what names one process (a pid is recycled, its start time is not);
    None when it is gone."""
    fields = stat_fields(pid)
    return None if fields is None or len(fields) < 20 else int(fields[19])


def started_s(pid: int) -> float | None:
    """When process ``pid`` started, in seconds since boot: on CLOCK_MONOTONIC's scale
    (suspend aside); None when it is gone."""
    ticks = start_ticks(pid)
    return None if ticks is None else ticks / os.sysconf("SC_CLK_TCK")


def running(pid: int) -> bool:
    """Whether process ``pid`` still runs on this machine: a zombie (ended, not yet
    reaped by its parent) counts as ended."""
    fields = stat_fields(pid)
    return fields is not None and fields[:1] not in ([b"Z"], [b"X"], [])


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
    except OSError:
        return []
