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
    assert f"--redis-url: Redis at {UNREACHABLE} cannot be reached to run this command" in err


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
    assert "cannot be reached to run this command" in capsys.readouterr().err
    assert (version / "model.onnx").is_file()


def test_the_message_never_shows_the_urls_password(capsys: pytest.CaptureFixture[str]) -> None:
    secret = "redis://:hunter2-not-shown@127.0.0.1:1/0"
    assert main(["index", "generations", "--redis-url", secret]) == 2
    err = capsys.readouterr().err
    assert "cannot be reached to run this command" in err
    assert "hunter2" not in err
    assert "--redis-url: Redis at redis://:***@127.0.0.1:1/0 cannot be reached" in err


def test_a_cluster_whose_seed_nodes_cannot_be_reached_is_said_too(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A cluster client connects when it is made: that, too, is said in flags."""
    cluster = "redis+cluster://127.0.0.1:1"
    assert main(["index", "generations", "--redis-url", cluster]) == 2
    err = capsys.readouterr().err
    assert f"--redis-url: Redis at {cluster} cannot be reached to run this command" in err


def test_a_url_read_from_a_file_names_that_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url_file = tmp_path / "redis.url"
    url_file.write_text(UNREACHABLE + "\n")
    assert main(["redis", "layout", "--shards", "2", "--redis-url-file", str(url_file)]) == 2
    err = capsys.readouterr().err
    assert f"--redis-url-file: Redis at {UNREACHABLE} cannot be reached" in err
