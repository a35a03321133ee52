"""One-shot commands against a store that cannot be reached: an error naming the flag
and the URL, exit 2, nothing done; not a redis-py traceback at the first read."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.cli.main import main

# nothing listens on port 1 of this host: the connection is refused at once
UNREACHABLE = "redis://127.0.0.1:1"


@pytest.mark.parametrize(
    "argv",
    [
        ["redis", "layout", "--shards", "2"],
        ["redis", "migrate", "--shards", "2"],
        ["index", "generations"],
        ["index", "retire", "--yes"],
    ],
    ids=["redis layout", "redis migrate", "index generations", "index retire"],
)
def test_a_store_that_cannot_be_reached_is_said_naming_the_flag(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*argv, "--redis-url", UNREACHABLE]) == 2
    err = capsys.readouterr().err
    assert f"--redis-url {UNREACHABLE}: the store cannot be reached" in err


def test_an_unpublish_that_cannot_ask_the_store_removes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Whether a generation uses the version is the store's to say: unreachable, the
    version stays."""
    version = tmp_path / "embed" / "3"
    version.mkdir(parents=True)
    (version / "model.onnx").write_bytes(b"not a model: only its presence is checked")
    argv = ["encoder", "unpublish", "--version", "3", "--repo", str(tmp_path)]
    assert main([*argv, "--redis-url", UNREACHABLE]) == 2
    assert "the store cannot be reached" in capsys.readouterr().err
    assert (version / "model.onnx").is_file()


def test_the_message_never_shows_the_urls_password(capsys: pytest.CaptureFixture[str]) -> None:
    secret = "redis://:hunter2-not-shown@127.0.0.1:1/0"
    assert main(["index", "generations", "--redis-url", secret]) == 2
    err = capsys.readouterr().err
    assert "the store cannot be reached" in err
    assert "hunter2" not in err
    assert "--redis-url redis://:***@127.0.0.1:1/0" in err
