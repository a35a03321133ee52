"""A rollout's CPU budget (issue #24; docs/generations.md "A rollout's CPU budget"): CPU
lists, where each process of the local stack goes, and pinning a real process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.common.errors import InvalidArgument
from services.generations.placement import Process, placement
from services.process import cpus as cpu_sets
from tests.support.processes import wait_until

MACHINE = frozenset({0, 1, 2, 3})


def test_cpu_lists_parse_as_taskset_writes_them() -> None:
    assert cpu_sets.parse_cpus("1") == {1}
    assert cpu_sets.parse_cpus("0,2-3") == {0, 2, 3}
    assert cpu_sets.format_cpus({5, 0, 2, 3}) == "0,2-3,5"


@pytest.mark.parametrize("spec", ["", "a", "3-1", "-1", "1-x", ","])
def test_a_malformed_cpu_list_is_invalid_argument(spec: str) -> None:
    with pytest.raises(InvalidArgument):
        cpu_sets.parse_cpus(spec)


@given(st.sets(st.integers(0, 200), min_size=1))
def test_format_and_parse_are_inverse(cpus: set[int]) -> None:
    assert cpu_sets.parse_cpus(cpu_sets.format_cpus(cpus)) == cpus


def test_a_budget_must_be_available_and_leave_serving_a_cpu() -> None:
    assert cpu_sets.budget_for("3", MACHINE) == {3}
    with pytest.raises(InvalidArgument, match="not on this machine"):
        cpu_sets.budget_for("4", MACHINE)
    with pytest.raises(InvalidArgument, match="leave at least one to serving"):
        cpu_sets.budget_for("0-3", MACHINE)


def test_with_a_budget_the_rollout_gets_it_and_serving_keeps_every_cpu() -> None:
    placed = placement([Process(10, False), Process(11, True)], MACHINE, frozenset({3}))
    assert placed == {10: MACHINE, 11: {3}}


@pytest.mark.parametrize("budget", [None, frozenset(), MACHINE, frozenset({7})])
def test_without_a_usable_budget_every_process_gets_every_cpu(
    budget: frozenset[int] | None,
) -> None:
    placed = placement([Process(10, False), Process(11, True)], MACHINE, budget)
    assert placed == {10: MACHINE, 11: MACHINE}


def test_cpu_seconds_of_this_process_grow_and_of_no_process_are_none() -> None:
    first = cpu_sets.cpu_seconds(os.getpid())
    assert first is not None
    deadline = os.times().elapsed + 5
    while cpu_sets.cpu_seconds(os.getpid()) == first and os.times().elapsed < deadline:
        sum(range(10_000))  # spend CPU until a clock tick shows it
    assert (cpu_sets.cpu_seconds(os.getpid()) or 0.0) > first
    assert cpu_sets.cpu_seconds(2**22 + 1) is None


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs two CPUs")
def test_pin_process_moves_every_thread_of_a_running_process() -> None:
    """A child with three threads: all of them end up on the one CPU, and back."""
    code = (
        "import threading,time\n" + "threading.Thread(target=time.sleep,args=(60,)).start()\n" * 2
    )
    child = subprocess.Popen([sys.executable, "-c", code + "time.sleep(60)"])
    try:
        tasks = f"/proc/{child.pid}/task"
        wait_until(lambda: len(os.listdir(tasks)) == 3, "the child's three threads", timeout=10)
        cpu = max(os.sched_getaffinity(0))
        assert cpu_sets.pin_process(child.pid, {cpu}) == 3
        assert {frozenset(os.sched_getaffinity(int(t))) for t in os.listdir(tasks)} == {
            frozenset({cpu})
        }
        assert cpu_sets.pin_process(child.pid, {cpu}) == 0, "nothing to change"
        assert cpu_sets.pin_process(child.pid, os.sched_getaffinity(0)) == 3
        assert child.pid in cpu_sets.children_of(os.getpid())
    finally:
        child.kill()
        child.wait()


def test_children_of_lists_the_children_every_thread_started_as_the_proc_scan_does() -> None:
    """``children_of`` reads the threads' ``children`` files (no scan of ``/proc`` on the
    stack's poller pass); a child started by a thread, even one that ended since, counts."""
    import threading

    started = [subprocess.Popen(["sleep", "60"])]
    thread = threading.Thread(target=lambda: started.append(subprocess.Popen(["sleep", "60"])))
    thread.start()
    thread.join()
    try:
        pids = sorted(child.pid for child in started)
        assert set(pids) <= set(cpu_sets.children_of(os.getpid()))
        assert cpu_sets.children_of(os.getpid()) == sorted(cpu_sets._scan_children(os.getpid()))
        assert cpu_sets.children_of(started[0].pid) == []
    finally:
        for child in started:
            child.kill()
            child.wait()
    assert cpu_sets.children_of(started[0].pid) == []  # gone


def test_the_stub_and_the_stack_name_the_same_budget_file() -> None:
    """The Triton stub cannot import services/: its own constant must match."""
    source = Path("services/encoder/build/triton_models/embed_onnx.py").read_text()
    assert f'BUDGET_FILE = "{cpu_sets.BUDGET_FILE}"' in source
    # beside the model folders, not in the version folder (whose change after the load
    # would make Triton reload the version; test_triton_versions checks the stub reads it)
    assert cpu_sets.budget_path("/r/embed/2/") == "/r/.embed.2.cpu-budget"


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("99", "are not on this machine"),
        ("x", "is not N or N-M"),
        (cpu_sets.format_cpus(cpu_sets.machine()), "leave at least one to serving"),
    ],
)
def test_index_rollout_refuses_a_budget_it_cannot_give_before_anything_else(
    spec: str, says: str
) -> None:
    """Exit 2 with the reason, before it reaches for Redis (whose address here answers
    nothing: reaching it would fail otherwise, and later)."""
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli.main",
            "index",
            "rollout",
            "--retrain",
            "--cpus",
            spec,
            "--redis-url",
            "redis://127.0.0.1:1",
            "--yes",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr
    assert says in run.stderr and "Traceback" not in run.stderr


def test_the_stack_finds_a_stubs_budget_beside_the_model_folders(tmp_path: Path) -> None:
    """``stub_budget_age`` reads a backend stub's argv (``triton_python_backend_stub
    <repo>/embed/<n>/model.py``) and the budget file of that version, which lives beside
    the model folders (a file in the version folder made Triton reload the version)."""
    from services.generations.placement import stub_budget_age

    version = tmp_path / "embed" / "2"
    version.mkdir(parents=True)
    (version / "model.py").write_text("import time\ntime.sleep(60)\n")
    stub = subprocess.Popen(  # a process whose argv is a stub's
        ["/opt/tritonserver/backends/python/triton_python_backend_stub", str(version / "model.py")],
        executable=sys.executable,
    )
    try:
        wait_until(lambda: len(cpu_sets.cmdline(stub.pid)) == 2, "the stub's argv", timeout=10)
        assert stub_budget_age(stub.pid) is None  # no budget
        (version / cpu_sets.BUDGET_FILE).write_text("1")  # where it was: not read any more
        assert stub_budget_age(stub.pid) is None
        Path(cpu_sets.budget_path(str(version))).write_text("1")
        age = stub_budget_age(stub.pid)
        assert age is not None and age < 60
        assert stub_budget_age(os.getpid()) is None  # not a stub
    finally:
        stub.kill()
        stub.wait()


def test_a_budget_parses_back_and_anything_else_is_invalid_argument() -> None:
    from services.generations import budget as rollout_budget

    assert rollout_budget.parse("1,3") == frozenset({1, 3})
    with pytest.raises(InvalidArgument):
        rollout_budget.parse("1,3 ending 4242")  # what a CLI before 2026-12-01 wrote


def test_a_process_counts_as_alive_until_it_has_exited() -> None:
    alive = cpu_sets.running
    assert alive(os.getpid())
    child = subprocess.Popen(["sleep", "60"])
    try:
        assert alive(child.pid)
        child.kill()
        # not reaped yet: a zombie has ended (its CPU use with it)
        wait_until(lambda: not alive(child.pid), "the killed child seen as ended", 10)
    finally:
        child.wait()
    assert not alive(child.pid)


def test_a_child_names_its_parent_and_its_start_on_the_monotonic_clock() -> None:
    before = time.monotonic()
    child = subprocess.Popen(["sleep", "60"])
    try:
        assert cpu_sets.parent_pid(child.pid) == os.getpid()
        started = cpu_sets.started_s(child.pid)
        # clock ticks (1/100 s) round the start down
        assert started is not None and before - 0.02 <= started <= time.monotonic()
    finally:
        child.kill()
        child.wait()
    assert cpu_sets.parent_pid(child.pid) is None and cpu_sets.started_s(child.pid) is None
