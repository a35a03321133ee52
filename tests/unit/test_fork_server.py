"""The stack's fork server (services/stack/forking.py): a forked child runs its entry
with its own argv, environment, CPUs, umask, session and log, and is seen through the
Popen surface the supervisor uses (exit codes, signals, a wait that times out)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from services.process.cpus import parent_pid, running
from services.stack.children import describe_exit
from services.stack.forking import ForkServer
from tests.support.processes import wait_until

CLI = [sys.executable, "-m", "services.cli.main"]  # an exec'd child's argv prefix


@pytest.fixture(scope="module")
def server() -> ForkServer:
    fork = ForkServer(preload=("json",), entry="tests.support.fork_probe:main")
    fork.start()
    return fork


def _seen(log: Path) -> dict[str, object]:
    return json.loads(log.read_text().splitlines()[-1])  # type: ignore[no-any-return]


def test_a_forked_child_runs_with_its_own_argv_environment_umask_session_and_log(
    server: ForkServer, tmp_path: Path
) -> None:
    log = tmp_path / "logs" / "child.log"
    log.parent.mkdir()
    log.write_text("an older line\n")
    env = {**os.environ, "GTR_FORK_PROBE": "mine"}
    old = os.umask(0o077)
    try:
        child = server.spawn([*CLI, "3", "--flag"], env, log)
    finally:
        os.umask(old)
    assert child.wait(60) == 3 and child.returncode == 3
    assert describe_exit(child.poll()) == "exited with 3"
    seen = _seen(log)
    assert log.read_text().startswith("an older line\n")  # appended to, as an exec'd child's
    assert seen["argv"] == ["3", "--flag"]
    assert seen["sys_argv"] == ["gtr-retrieval", "3", "--flag"]
    assert seen["probe"] == "mine"
    assert seen["umask"] == 0o077  # the one at spawn, not the fork server's
    assert seen["session_leader"] and seen["group_leader"]  # killpg(pid) reaches it alone
    assert seen["stdin"] == os.devnull
    assert "GTR_FORK_PROBE" not in os.environ  # the parent's environment is untouched


@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="pinning to a subset needs two usable CPUs"
)
def test_a_forked_child_runs_on_the_cpus_it_was_given(server: ForkServer, tmp_path: Path) -> None:
    one = max(os.sched_getaffinity(0))
    log = tmp_path / "child.log"
    child = server.spawn([*CLI, "0"], dict(os.environ), log, frozenset({one}))
    assert child.wait(60) == 0
    assert _seen(log)["cpus"] == [one]
    log2 = tmp_path / "child2.log"
    every = server.spawn([*CLI, "0"], dict(os.environ), log2)
    assert every.wait(60) == 0
    assert _seen(log2)["cpus"] == sorted(os.sched_getaffinity(0))


def test_a_killed_child_reports_its_signal_and_a_wait_times_out_while_it_runs(
    server: ForkServer, tmp_path: Path
) -> None:
    log = tmp_path / "child.log"
    child = server.spawn([*CLI, "wait"], dict(os.environ), log)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(0.2)
        assert child.poll() is None
    finally:
        os.killpg(child.pid, signal.SIGKILL)  # what Child.stop sends after its grace
    assert child.wait(60) == -signal.SIGKILL
    assert describe_exit(child.returncode) == "killed by SIGKILL"


def test_a_child_whose_fork_server_died_is_still_seen_running_and_stopped(
    server: ForkServer, tmp_path: Path
) -> None:
    """A SIGTERM to up's process group reaches the fork server, not the shards (sessions
    of their own). The server's death must not pass for theirs: taken for ended, they
    were never stopped and outlived up."""
    child = server.spawn([*CLI, "wait"], dict(os.environ), tmp_path / "child.log")
    try:
        wait_until(lambda: (tmp_path / "child.log").exists(), "the child running", 30)
        fork_server = parent_pid(child.pid)
        assert fork_server is not None and fork_server != os.getpid()
        os.kill(fork_server, signal.SIGTERM)
        wait_until(lambda: not running(fork_server), "the fork server gone", 30)
        assert child.poll() is None  # running on, and said so
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(0.2)
    finally:
        os.killpg(child.pid, signal.SIGTERM)
    assert child.wait(30) is not None and child.poll() is not None  # its end is seen
    assert not running(child.pid)
    # the next spawn starts a fork server again
    again = server.spawn([*CLI, "0"], dict(os.environ), tmp_path / "again.log")
    assert again.wait(60) == 0


def test_the_umask_given_to_a_child_is_read_without_changing_it() -> None:
    """Set to 0 to read it back, the umask of up's other threads would be 0 meanwhile."""
    from services.stack.forking import current_umask

    old = os.umask(0o027)
    try:
        assert current_umask() == 0o027
        assert os.umask(0o027) == 0o027  # still what it was
    finally:
        os.umask(old)
