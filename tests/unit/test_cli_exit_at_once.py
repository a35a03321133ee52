"""`index rollout` run as the program ends without the interpreter's teardown (a core for
~1.6 s as the new generation begins to serve), its exit code and output kept; and a
store that cannot be reached is said in flags, not in a redis-py traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
# nothing listens on port 1 of this host: the connection is refused at once
UNREACHABLE = "redis://127.0.0.1:1"


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    """``gtr-retrieval argv`` as the program, with an exit handler that says it ran."""
    program = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('teardown ran', flush=True))\n"
        "from services.cli.main import main\n"
        f"sys.argv = ['gtr-retrieval', *{list(argv)!r}]\n"
        "sys.exit(main())\n"
    )
    return subprocess.run(
        [sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("command", [["rollout", "--yes"], ["rollback", "--yes"]])
def test_a_rollout_as_the_program_skips_the_teardown_and_keeps_its_code(
    command: list[str],
) -> None:
    done = run("index", *command, "--redis-url", UNREACHABLE)
    assert done.returncode == 2, done.stderr
    assert (
        f"--redis-url: Redis at {UNREACHABLE} cannot be reached to run this command" in done.stderr
    )
    assert "Traceback" not in done.stderr
    assert "teardown ran" not in done.stdout


def test_other_commands_end_as_usual() -> None:
    done = run("index", "generations", "--redis-url", UNREACHABLE)
    assert done.returncode == 2, done.stderr
    assert "cannot be reached to run this command" in done.stderr
    assert "teardown ran" in done.stdout


def test_called_in_process_the_rollout_returns_its_code() -> None:
    from services.cli.main import main

    assert main(["index", "rollout", "--yes", "--redis-url", UNREACHABLE]) == 2


def _at_command_import(*argv: str, session: bool = False) -> tuple[dict[str, Any], str]:
    """``gtr-retrieval argv`` as the program (``session``: leading a session of its own, as
    the bench and ``up``'s children run): its CPUs, its thread's nice and its autogroup's
    nice when the first command module is imported (building the parser), and its stderr."""
    program = (
        "import importlib.abc, json, os, sys\n"
        "from services.process.priority import group_nice\n"
        "class Spy(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'services.cli.client_commands':\n"
        "            seen = {'cpus': sorted(os.sched_getaffinity(0)),\n"
        "                    'nice': os.getpriority(os.PRIO_PROCESS, 0),\n"
        "                    'group': group_nice(os.getpid())}\n"
        "            print('at import', json.dumps(seen), flush=True)\n"
        "sys.meta_path.insert(0, Spy())\n"
        "from services.cli.main import main\n"
        f"sys.argv = ['gtr-retrieval', *{list(argv)!r}]\n"
        "sys.exit(main())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=session,
    )
    line = next((x for x in done.stdout.splitlines() if x.startswith("at import")), "")
    return (json.loads(line.removeprefix("at import ")) if line else {}), done.stderr


@pytest.mark.skipif(
    len(getattr(os, "sched_getaffinity", lambda _pid: set())(0)) < 2,
    reason="a CPU budget needs two CPUs to leave one to serving",
)
@pytest.mark.parametrize("form", ["separate", "joined"])
def test_a_rollout_with_a_cpu_budget_runs_there_before_its_commands_are_imported(
    form: str,
) -> None:
    last = max(os.sched_getaffinity(0))
    cpus = ["--cpus", str(last)] if form == "separate" else [f"--cpus={last}"]
    seen, stderr = _at_command_import(
        "index", "rollout", "--retrain", "--yes", *cpus, "--redis-url", UNREACHABLE
    )
    assert seen["cpus"] == [last], stderr
    # not another command, nor a spec the handler refuses (it says why, as before)
    everywhere = sorted(os.sched_getaffinity(0))
    assert (
        _at_command_import("index", "generations", "--redis-url", UNREACHABLE)[0]["cpus"]
        == everywhere
    )
    seen, stderr = _at_command_import(
        "index", "rollout", "--yes", "--cpus", "9999", "--redis-url", UNREACHABLE
    )
    assert seen["cpus"] == everywhere
    assert "--cpus 9999" in stderr


@pytest.mark.skipif(
    len(getattr(os, "sched_getaffinity", lambda _pid: set())(0)) < 2,
    reason="a CPU budget needs two CPUs to leave one to serving",
)
def test_a_rollout_with_a_cpu_budget_yields_from_before_its_commands_are_imported() -> None:
    """Its thread at nice 19 (its threads inherit it) and, leading its session, its
    autogroup too (services/process/priority.py); not leading one, the session it shares
    (this test's) keeps its weight. Other commands keep theirs."""
    from services.process.priority import autogroup_enabled, group_nice

    last = max(os.sched_getaffinity(0))
    rollout = ("index", "rollout", "--retrain", "--yes", "--cpus", str(last))
    mine = group_nice(os.getpid())
    seen, stderr = _at_command_import(*rollout, "--redis-url", UNREACHABLE)
    assert seen["nice"] == 19, stderr
    assert seen["group"] == mine and group_nice(os.getpid()) == mine
    other, _ = _at_command_import("index", "generations", "--redis-url", UNREACHABLE, session=True)
    assert other["nice"] == os.getpriority(os.PRIO_PROCESS, 0)
    if not autogroup_enabled():
        pytest.skip("the kernel has no autogroup (kernel.sched_autogroup_enabled is not 1)")
    assert other["group"] == 0
    seen, stderr = _at_command_import(*rollout, "--redis-url", UNREACHABLE, session=True)
    assert (seen["nice"], seen["group"]) == (19, 19), stderr
