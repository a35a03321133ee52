"""A rollout's processes paused while searches run (services/process/hold.py): real child
processes, stopped and continued by the gateway's :class:`Holder` as searches begin and
end, never longer than its bound, never a pid that names another process now; ``up``'s
:class:`HoldList` continues what leaves the list and what a killed gateway held."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from services.generations import placement
from services.generations.state import RolloutState
from services.process import cpus as cpu_sets
from services.process import hold
from tests.support.processes import await_until, wait_until


def _state(pid: int) -> bytes:
    fields = cpu_sets.stat_fields(pid)
    assert fields is not None, f"{pid} is gone"
    return fields[0]


def _stopped(pid: int) -> bool:
    return _state(pid) == b"T"


def _listed(tmp_path: Path, *pids: int) -> Path:
    """The hold list naming ``pids``, as ``up`` writes it."""
    path = tmp_path / hold.HOLD_FILE
    hold.write(path, pids)
    return path


@pytest.fixture
def children() -> Iterator[Callable[[], subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        child = subprocess.Popen(
            [sys.executable, "-c", "import time\nwhile True: time.sleep(0.01)\n"],
            start_new_session=True,
        )
        started.append(child)
        return child

    yield start
    for child in started:
        child.kill()
        child.wait()


def test_the_list_names_each_process_with_its_start_time(children, tmp_path: Path) -> None:
    a, b = children(), children()
    path = tmp_path / hold.HOLD_FILE
    listed = hold.write(path, [a.pid, b.pid, 2**22 + 7])  # the last: no such process
    assert listed == {p: cpu_sets.start_ticks(p) for p in (a.pid, b.pid)}
    assert hold.read(path) == listed
    assert path.stat().st_mode & 0o777 == 0o600
    assert hold.read(tmp_path / "missing.json") == {}


def test_a_search_in_flight_stops_the_listed_processes_until_the_last_one_ends(
    children, tmp_path: Path
) -> None:
    async def scenario() -> None:
        a, b = children(), children()
        path = _listed(tmp_path, a.pid, b.pid)
        holder = hold.Holder(path, max_hold_s=60.0)
        try:
            with holder.searching():
                await await_until(lambda: _stopped(a.pid) and _stopped(b.pid), "both stopped")
                with holder.searching():  # a second search overlaps the first
                    pass
                assert _stopped(a.pid) and _stopped(b.pid), "continued while a search runs"
            await await_until(lambda: not _stopped(a.pid) and not _stopped(b.pid), "continued")
            assert holder.holds == 1 and holder.held_s > 0
        finally:
            holder.close()

    asyncio.run(scenario())


def test_a_hold_ends_at_its_bound_while_searches_go_on(children, tmp_path: Path) -> None:
    async def scenario() -> None:
        a = children()
        path = _listed(tmp_path, a.pid)
        holder = hold.Holder(path, max_hold_s=0.3)
        try:
            with holder.searching():
                await await_until(lambda: _stopped(a.pid), "stopped")
                took = await await_until(lambda: not _stopped(a.pid), "continued at the bound")
                assert holder.in_flight == 1  # the search still runs
            assert took < 5.0
            with holder.searching():  # the next search holds it again
                await await_until(lambda: _stopped(a.pid), "stopped again")
            assert holder.holds == 2
        finally:
            holder.close()

    asyncio.run(scenario())


def test_a_pid_that_names_another_process_now_is_never_signalled(children, tmp_path: Path) -> None:
    async def scenario() -> None:
        a = children()
        path = tmp_path / hold.HOLD_FILE
        started = cpu_sets.start_ticks(a.pid)
        assert started is not None
        # the list's start time is not this process's: the pid was recycled since it was listed
        path.write_text(f'{{"processes": [[{a.pid}, {started - 1}]]}}')
        holder = hold.Holder(path, max_hold_s=60.0)
        try:
            with holder.searching():
                await asyncio.sleep(0)
                assert holder.holds == 0
                assert not _stopped(a.pid)
        finally:
            holder.close()

    asyncio.run(scenario())


def test_the_holder_follows_the_list_and_closing_continues_what_it_holds(
    children, tmp_path: Path
) -> None:
    async def scenario() -> None:
        a, b = children(), children()
        path = _listed(tmp_path, a.pid)
        holder = hold.Holder(path, max_hold_s=60.0)
        with holder.searching():
            await await_until(lambda: _stopped(a.pid), "a stopped")
        hold.write(path, [b.pid])  # the rollout's processes changed
        os.utime(path, ns=(0, 1))  # a new stamp even within the file system's time grain
        with holder.searching():
            await await_until(lambda: _stopped(b.pid), "b stopped")
            assert not _stopped(a.pid)
            holder.close()  # the gateway stops with a search in flight
            await await_until(lambda: not _stopped(b.pid), "b continued by close")

    asyncio.run(scenario())


def test_up_continues_what_leaves_the_list_and_what_a_killed_gateway_held(
    children, tmp_path: Path
) -> None:
    a, b = children(), children()
    path = _listed(tmp_path, a.pid, b.pid)
    for child in (a, b):  # held by a gateway that was then killed
        os.kill(child.pid, signal.SIGSTOP)
    wait_until(lambda: _stopped(a.pid) and _stopped(b.pid), "both stopped")
    listing = hold.HoldList(path)
    listing.start()
    wait_until(lambda: not _stopped(a.pid) and not _stopped(b.pid), "continued at start")
    assert hold.read(path) == {}
    listing.update([a.pid, b.pid])
    assert set(hold.read(path)) == {a.pid, b.pid}
    os.kill(b.pid, signal.SIGSTOP)  # the gateway holds it as the rollout hands it over
    wait_until(lambda: _stopped(b.pid), "b stopped")
    listing.update([a.pid])
    assert set(hold.read(path)) == {a.pid}
    wait_until(lambda: not _stopped(b.pid), "b continued once off the list")


def test_up_rewrites_the_list_only_when_it_asks_for_other_processes(
    children, tmp_path: Path
) -> None:
    """A pass that names the processes the pass before named writes nothing, a dead one
    among them too (the list written left it out: the file was rewritten on every pass
    while the poller still named it)."""
    a, b = children(), children()
    path = tmp_path / hold.HOLD_FILE
    listing = hold.HoldList(path)
    listing.start()
    b.kill()
    b.wait()
    listing.update([a.pid, b.pid])
    assert set(hold.read(path)) == {a.pid}
    written = path.stat().st_ino  # each write replaces the file (a new inode)
    listing.update([b.pid, a.pid])
    assert path.stat().st_ino == written
    listing.update([a.pid])
    assert path.stat().st_ino != written and set(hold.read(path)) == {a.pid}


def test_a_gateway_that_starts_continues_what_a_killed_one_held(children, tmp_path: Path) -> None:
    a = children()
    path = _listed(tmp_path, a.pid)
    os.kill(a.pid, signal.SIGSTOP)  # held by a gateway that was then killed
    wait_until(lambda: _stopped(a.pid), "stopped")
    holder = hold.Holder.opened(path, max_hold_s=60.0)
    try:
        wait_until(lambda: not _stopped(a.pid), "continued as the new gateway starts")
        assert holder.holds == 0
    finally:
        holder.close()


def test_the_rollouts_cli_is_listed_only_in_a_session_of_its_own_and_as_a_rollout() -> None:
    """``up`` lists the CLI the rollout's record names when it runs here, leads its own
    session and runs ``index rollout`` (or ``rollback``): the pid of a builder that died
    may name another process by now, and one in a terminal's session would show as
    stopped in its shell."""
    loop = "import time\nwhile True: time.sleep(0.01)\n"
    started = [
        subprocess.Popen([sys.executable, "-c", loop, *argv], start_new_session=session)
        for argv, session in (
            (["index", "rollout", "--retrain"], True),  # listed
            (["index", "rollback"], True),  # listed
            (["serve", "rollout"], True),  # not a rollout's CLI: a recycled pid
            (["index", "rollout"], False),  # in this (a terminal's) session
        )
    ]
    try:
        wanted = [p.pid for p in started]
        wait_until(lambda: all(len(cpu_sets.cmdline(pid)) > 3 for pid in wanted), "their argv set")
        listed = [
            pid
            for pid in wanted
            if placement.held([], RolloutState(target="g2", host=socket.gethostname(), pid=pid))
        ]
        assert listed == wanted[:2]
        elsewhere = RolloutState(target="g2", host="another-host", pid=wanted[0])
        assert placement.held([placement.Process(7, True)], elsewhere) == [7]
    finally:
        for child in started:
            child.kill()
            child.wait()
