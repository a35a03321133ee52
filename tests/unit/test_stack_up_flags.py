"""`up`'s flags: counts that make no stack are refused before anything starts, and `up`
asks to end without the interpreter's teardown once its children stopped."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from services.cli.main import build_parser
from services.cli.stack_commands import stack_config


@pytest.mark.parametrize("flag", ["--shards", "--replicas"])
def test_up_refuses_no_shards_or_no_replicas_before_starting_anything(
    flag: str, tmp_path: Path
) -> None:
    args = build_parser().parse_args(["up", "--run-dir", str(tmp_path), flag, "0"])
    with pytest.raises(SystemExit, match=f"error: {flag} must be at least 1"):
        stack_config(args)
    assert not any(tmp_path.iterdir()), "nothing is written for a refused stack"


def test_up_refuses_a_corpus_that_is_not_a_file_before_starting_anything(tmp_path: Path) -> None:
    """Before, Redis and Triton started and the model was exported (~30 s here) first."""
    run_dir = tmp_path / "run"
    missing = tmp_path / "none.jsonl"
    args = build_parser().parse_args(["up", "--run-dir", str(run_dir), "--corpus", str(missing)])
    with pytest.raises(SystemExit, match=re.escape(f"error: --corpus {missing}: no such file")):
        stack_config(args)
    assert not run_dir.exists()


def test_up_asks_to_end_without_the_interpreters_teardown(tmp_path: Path) -> None:
    """`services.cli.main.exit_at_once` (tested on `index rollout` in
    tests/unit/test_cli_exit_at_once.py): after `up` stopped its children, the teardown of
    torch, ONNX Runtime and faiss took 2.5 s of a core (py-spy, a stack of 300 documents)."""
    args = build_parser().parse_args(["up", "--run-dir", str(tmp_path)])
    assert args.exit_at_once is True
