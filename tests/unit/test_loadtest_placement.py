"""loadtest.placement: CPU lists, the split, and pinning real processes and threads."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from loadtest import placement
from tests.support.processes import wait_until

# A process with an extra thread and a child process, both alive until stdin closes.
FAMILY = """
import subprocess, sys, threading
child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                         stdin=subprocess.PIPE)
threading.Thread(target=sys.stdin.read, daemon=True).start()
print(child.pid, flush=True)
threading.Event().wait()
"""


def allowed(tid: int) -> frozenset[int]:
    return frozenset(os.sched_getaffinity(tid))


@pytest.fixture
def family_proc() -> Iterator[tuple[subprocess.Popen[str], int]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", FAMILY], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    try:
        yield proc, child
    finally:
        proc.kill()
        proc.wait(10)
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, 9)


@pytest.fixture
def family(family_proc: tuple[subprocess.Popen[str], int]) -> tuple[int, int]:
    return family_proc[0].pid, family_proc[1]


@pytest.fixture
def usable() -> frozenset[int]:
    """This process's CPUs; a pinning test needs two, to pin to a proper subset."""
    cpus = placement.usable_cpus()
    if len(cpus) < 2:
        pytest.skip(f"pinning to a subset needs two usable CPUs; this process has {cpus}")
    return cpus


def test_cpu_lists_are_read_as_taskset_writes_them() -> None:
    assert placement.parse_cpus("1") == {1}
    assert placement.parse_cpus("0,2-4") == {0, 2, 3, 4}
    for bad in ("", "a", "3-1", "-1", "1-"):
        with pytest.raises(ValueError, match="not a CPU list"):
            placement.parse_cpus(bad)


def test_the_default_split_gives_the_encoder_the_upper_half() -> None:
    assert placement.split_cpus([0, 1]) == placement.Split(frozenset({1}), frozenset({0}))
    assert placement.split_cpus(range(8)).encoder == {4, 5, 6, 7}
    assert placement.split_cpus([0, 1, 2], frozenset({0})).stack == {1, 2}
    with pytest.raises(ValueError, match="two CPUs"):
        placement.split_cpus([0])
    with pytest.raises(ValueError, match="not usable"):
        placement.split_cpus([0, 1], frozenset({5}))
    with pytest.raises(ValueError, match="at least one CPU"):
        placement.split_cpus([0, 1], frozenset({0, 1}))


def test_descendants_are_found_through_proc(family: tuple[int, int]) -> None:
    parent, child = family
    assert set(placement.with_descendants(parent)) == {parent, child}
    assert len(placement.threads(parent)) >= 2  # the main thread and the extra one


def test_every_thread_and_descendant_is_pinned_and_then_restored(
    family: tuple[int, int], usable: frozenset[int]
) -> None:
    parent, child = family
    target = frozenset({max(usable)})
    before = {tid: allowed(tid) for pid in (parent, child) for tid in placement.threads(pid)}
    assert all(cpus != target for cpus in before.values())
    with placement.pinned({target: [parent]}):
        now = {tid: allowed(tid) for pid in (parent, child) for tid in placement.threads(pid)}
        assert set(now) == set(before) and all(cpus == target for cpus in now.values())
    assert {tid: allowed(tid) for tid in before} == before


def test_a_process_gone_before_the_restore_is_not_an_error(
    family_proc: tuple[subprocess.Popen[str], int], usable: frozenset[int]
) -> None:
    proc, child = family_proc
    before = allowed(child)
    with placement.pinned({frozenset({min(usable)}): [proc.pid]}):
        proc.kill()
        proc.wait(10)  # reaped: its threads are gone when the block restores them
        assert placement.threads(proc.pid) == []
    assert allowed(child) == before  # the survivor got its CPUs back all the same


def test_stack_children_are_the_running_children_of_a_stack_json(
    family: tuple[int, int],
) -> None:
    parent, child = family
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    stack = {
        "children": [
            {"name": "triton", "pid": parent, "state": "running"},
            {"name": "gateway", "pid": child, "state": "running"},
            {"name": "redis", "pid": int(gone.stdout), "state": "running"},  # exited
            {"name": "rerank", "pid": child, "state": "stopped"},
        ]
    }
    assert placement.stack_children(stack) == {"triton": parent, "gateway": child}
    assert placement.stack_children({}) == {}


def test_without_descendants_only_the_process_itself_is_pinned(
    family: tuple[int, int], usable: frozenset[int]
) -> None:
    """A load generator that started the stack it measures pins itself, not the stack."""
    parent, child = family
    target = frozenset({max(usable)})
    child_before = allowed(child)
    with placement.pinned({target: [parent]}, descendants=False):
        assert all(allowed(t) == target for t in placement.threads(parent))
        assert allowed(child) == child_before != target


def test_cpu_seconds_counts_descendants_only_when_asked() -> None:
    """An idle parent whose child spins: the child's CPU is in the parent's total and
    not in the parent's own."""
    spinner = "import subprocess, sys\n" + (
        "c = subprocess.Popen([sys.executable, '-c', 'while True: pass'])\n"
        "print(c.pid, flush=True)\nsys.stdin.read()\nc.kill()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", spinner], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    try:
        wait_until(
            lambda: placement.cpu_seconds(child) >= 0.2, "the child has spun 0.2 s", timeout=30
        )
        own = placement.cpu_seconds(proc.pid, descendants=False)
        total = placement.cpu_seconds(proc.pid)
        assert round(total - own, 2) >= 0.2 and own < 0.2  # clock ticks: 0.01 s
    finally:
        proc.kill()
        proc.wait(10)
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, 9)
