"""``gtr-retrieval encoder …`` wired through argparse as the main CLI will do it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from services.cli.encoder_commands import add_cli
from services.encoder.build.repository import read_config
from tests.encoder_fixtures import encoder_base, ensure_tiny_t5


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gtr-retrieval")
    add_cli(parser.add_subparsers(dest="command", required=True))
    return parser


def _main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    return int(args.func(args))


@pytest.mark.parametrize("command", ["export", "parity", "repo", "build-plan"])
def test_every_command_has_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse_args(["encoder", command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "usage: gtr-retrieval encoder " + command in out
    assert "--onnx" in out or "--out" in out


def test_flavor_is_validated(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["encoder", "repo", "--onnx", "x", "--out", "y", "--flavor", "tpu"])
    assert "invalid choice: 'tpu'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value", "said"),
    [
        ("--max-queue-size", "-3", "-3 is negative"),
        ("--queue-delay-us", "1.5", "'1.5' is not a whole number"),
    ],
)
def test_queue_flags_are_validated(
    flag: str, value: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["encoder", "repo", "--onnx", "x", "--out", "y", flag, value])
    assert f"argument {flag}: {said}" in capsys.readouterr().err


def test_export_parity_repo_round_trip(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = ensure_tiny_t5(encoder_base(tmp_path_factory))
    onnx_path = tmp_path / "export" / "model.onnx"
    assert _main(["encoder", "export", "--model-dir", str(model_dir), "--out", str(onnx_path)]) == 0
    out = capsys.readouterr().out
    assert "parity OK" in out and "recorded in parity.json" in out
    assert json.loads((onnx_path.parent / "parity.json").read_text())["passed"] is True
    parity = ["encoder", "parity", "--model-dir", str(model_dir), "--onnx", str(onnx_path)]
    assert _main(parity) == 0
    repo = tmp_path / "repo"
    assert (
        _main(
            [
                "encoder",
                "repo",
                "--onnx",
                str(onnx_path),
                "--out",
                str(repo),
                "--flavor",
                "cpu",
                "--threads",
                "2",
            ]
        )
        == 0
    )
    assert read_config(repo / "embed" / "config.pbtxt").parameters["dim"].string_value == "48"


def test_errors_become_exit_status_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "missing.onnx")
    code = _main(["encoder", "repo", "--onnx", missing, "--out", str(tmp_path)])
    assert code == 2
    assert "run `encoder export` first" in capsys.readouterr().err


def test_build_plan_says_why_it_cannot_run_here(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util

    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("tensorrt is installed: this checks the message on machines without it")
    model_dir = ensure_tiny_t5(encoder_base(tmp_path_factory))
    code = _main(
        [
            "encoder",
            "build-plan",
            "--model-dir",
            str(model_dir),
            "--onnx",
            str(tmp_path / "m.onnx"),
            "--out",
            str(tmp_path / "m.plan"),
        ]
    )
    assert code == 2 and "no GPU/TensorRT on this machine" in capsys.readouterr().err
