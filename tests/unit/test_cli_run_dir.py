"""The client commands find a local stack started with ``up --run-dir DIR``: by their
own --run-dir, by $GTR_RUN_DIR, else by ``.run`` in the working directory; and ``up``
prints a first search command that finds it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.cli.main import build_parser
from services.client.gateway import resolve_gateway
from services.stack.config import StackConfig
from services.stack.launcher import Stack


def _stack(run_dir: Path, gateway: str) -> None:
    """A stack.json as ``up --auth`` writes it (the fields the client reads)."""
    auth = run_dir / "auth"
    auth.mkdir(parents=True)
    (auth / "write.tokens").write_text(f"write-{gateway}\n", encoding="utf-8")
    state = {"gateway": gateway, "write_tokens_file": str(auth / "write.tokens")}
    (run_dir / "stack.json").write_text(json.dumps(state), encoding="utf-8")


@pytest.fixture
def stacks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """One stack in ``<cwd>/.run`` (port 1111) and one in ``<tmp>/qa-run`` (port 2222)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("GTR_RUN_DIR", raising=False)
    monkeypatch.delenv("GTR_GATEWAY_ADDRESS", raising=False)
    monkeypatch.delenv("GTR_TOKEN", raising=False)
    _stack(tmp_path / ".run", "127.0.0.1:1111")
    _stack(tmp_path / "qa-run", "127.0.0.1:2222")
    return tmp_path / "qa-run"


COMMANDS = [["search", "q"], ["get", "x"], ["delete", "x"], ["ingest", "f"]]


@pytest.mark.parametrize("command", COMMANDS)
def test_run_dir_flag_names_the_stack(stacks: Path, command: list[str]) -> None:
    args = build_parser().parse_args([*command, "--run-dir", str(stacks)])
    gateway = resolve_gateway(args)
    assert (gateway.address, gateway.token) == ("127.0.0.1:2222", "write-127.0.0.1:2222")


def test_environment_names_the_stack(stacks: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GTR_RUN_DIR", str(stacks))
    gateway = resolve_gateway(build_parser().parse_args(["search", "q"]))
    assert (gateway.address, gateway.token) == ("127.0.0.1:2222", "write-127.0.0.1:2222")


def test_without_either_the_stack_in_dot_run(stacks: Path) -> None:
    gateway = resolve_gateway(build_parser().parse_args(["search", "q"]))
    assert (gateway.address, gateway.token) == ("127.0.0.1:1111", "write-127.0.0.1:1111")


def _hint(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> str:
    Stack(StackConfig(run_dir=run_dir)).print_endpoints(Path("corpus.jsonl"))
    return next(line for line in capsys.readouterr().out.splitlines() if "try:" in line)


def test_up_prints_a_search_that_finds_its_run_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _hint(tmp_path / "qa-run", capsys).endswith(f'" --run-dir {tmp_path / "qa-run"}')
    assert _hint(Path(".run"), capsys).endswith('search "read a csv file"')
