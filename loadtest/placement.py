"""CPU placement of a local stack: the encoder on cores of its own, everything else on
the rest, for as long as a measurement takes.

In production Triton runs on its own GPU node and the gateway, the shards and Redis on
others; on one small machine they all share the same cores, and a throughput ratio
then measures CPU cost per search rather than whether the gateway keeps the encoder
busy. :func:`pinned` gives each side its own cores (Linux ``sched_setaffinity`` on every
thread of every process and its descendants) and puts every thread back as it was.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class Split:
    """Which CPUs the encoder gets and which the rest of the stack (and the load
    generator) gets; disjoint and both non-empty."""

    encoder: frozenset[int]
    stack: frozenset[int]

    def __post_init__(self) -> None:
        if not self.encoder or not self.stack:
            raise ValueError("both sides need at least one CPU")
        if self.encoder & self.stack:
            raise ValueError(f"CPUs {sorted(self.encoder & self.stack)} are on both sides")


def usable_cpus() -> frozenset[int]:
    return frozenset(os.sched_getaffinity(0))


def parse_cpus(text: str) -> frozenset[int]:
    """``"1"``, ``"2,3"`` or ``"4-7"`` (as taskset and cpusets write them)."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            lo, hi = int(first), int(last if dash else first)
        except ValueError:
            raise ValueError(f"not a CPU list: {text!r} (e.g. 1 or 2,3 or 4-7)") from None
        if lo < 0 or hi < lo:
            raise ValueError(f"not a CPU list: {text!r} (e.g. 1 or 2,3 or 4-7)")
        cpus.update(range(lo, hi + 1))
    return frozenset(cpus)


def split_cpus(available: Iterable[int], encoder: frozenset[int] | None = None) -> Split:
    """``encoder`` (default: the upper half of ``available``, at least one) for the
    encoder, the rest of ``available`` for everything else."""
    cpus = sorted(set(available))
    if len(cpus) < 2:
        raise ValueError(f"a split needs two CPUs or more; this process may use {cpus}")
    if encoder is None:
        encoder = frozenset(cpus[len(cpus) // 2 :])
    if not encoder <= set(cpus):
        raise ValueError(f"encoder CPUs {sorted(encoder - set(cpus))} are not usable here")
    return Split(encoder=encoder, stack=frozenset(cpus) - encoder)


def threads(pid: int) -> list[int]:
    """The thread ids of ``pid`` (empty once it has exited)."""
    try:
        return [int(tid) for tid in os.listdir(PROC / str(pid) / "task")]
    except FileNotFoundError:
        return []


def with_descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (Triton's Python-backend stubs, say)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        for tid in threads(current):
            try:
                children = (PROC / str(current) / "task" / str(tid) / "children").read_text()
            except (FileNotFoundError, ProcessLookupError):
                continue
            todo.extend(int(c) for c in children.split() if int(c) not in found)
    return found


@contextmanager
def pinned(
    groups: Mapping[frozenset[int], Iterable[int]], descendants: bool = True
) -> Iterator[None]:
    """Pin every thread of each process in ``groups[cpus]`` (and of its descendants,
    unless ``descendants`` is False: a load generator that started the stack it
    measures) to ``cpus`` until the block ends, then restore each thread's own former
    affinity. Threads and processes started inside the block inherit their creator's."""
    saved: dict[int, set[int]] = {}
    try:
        for cpus, pids in groups.items():
            for pid in pids:
                for proc in with_descendants(pid) if descendants else [pid]:
                    for tid in threads(proc):
                        try:
                            saved.setdefault(tid, os.sched_getaffinity(tid))
                            os.sched_setaffinity(tid, cpus)
                        except ProcessLookupError:
                            saved.pop(tid, None)
        yield
    finally:
        for tid, former in saved.items():
            with suppress(ProcessLookupError):
                os.sched_setaffinity(tid, former)


TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int, descendants: bool = True) -> float:
    """User + system CPU of ``pid`` (and its live descendants) so far (0 once gone)."""
    total = 0
    for proc in with_descendants(pid) if descendants else [pid]:
        try:
            stat = (PROC / str(proc) / "stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return total / TICKS_PER_S


def stack_children(stack: Mapping[str, object]) -> dict[str, int]:
    """name → pid of a stack.json's running children that are alive on this machine."""
    out: dict[str, int] = {}
    children = stack.get("children")
    for child in children if isinstance(children, list) else []:
        pid = child.get("pid")
        if child.get("state") == "running" and isinstance(pid, int) and threads(pid):
            out[str(child.get("name"))] = pid
    return out
