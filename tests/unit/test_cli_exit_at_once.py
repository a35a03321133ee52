"""`index rollout` run as the program ends without the interpreter's teardown (a core for
~1.6 s as the new generation begins to serve), its exit code and output kept; and a
store that cannot be reached is said in flags, not in a redis-py traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


def _affinity_at_command_import(*argv: str) -> tuple[str, str]:
    """``gtr-retrieval argv`` as the program: the CPUs it may run on when the first
    command module is imported (building the parser), and its stderr."""
    program = (
        "import importlib.abc, os, sys\n"
        "class Spy(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'services.cli.client_commands':\n"
        "            print('at import', sorted(os.sched_getaffinity(0)), flush=True)\n"
        "sys.meta_path.insert(0, Spy())\n"
        "from services.cli.main import main\n"
        f"sys.argv = ['gtr-retrieval', *{list(argv)!r}]\n"
        "sys.exit(main())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    line = next((x for x in done.stdout.splitlines() if x.startswith("at import")), "")
    return line.removeprefix("at import "), done.stderr


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
    where, stderr = _affinity_at_command_import(
        "index", "rollout", "--retrain", "--yes", *cpus, "--redis-url", UNREACHABLE
    )
    assert where == f"[{last}]", stderr
    # not another command, nor a spec the handler refuses (it says why, as before)
    everywhere = str(sorted(os.sched_getaffinity(0)))
    assert (
        _affinity_at_command_import("index", "generations", "--redis-url", UNREACHABLE)[0]
        == everywhere
    )
    where, stderr = _affinity_at_command_import(
        "index", "rollout", "--yes", "--cpus", "9999", "--redis-url", UNREACHABLE
    )
    assert where == everywhere
    assert "--cpus 9999" in stderr
