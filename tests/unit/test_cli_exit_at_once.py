"""`index rollout` run as the program ends without the interpreter's teardown (a core for
~1.6 s as the new generation begins to serve), its exit code and output kept; and a
store that cannot be reached is said in flags, not in a redis-py traceback."""

from __future__ import annotations

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
