"""A one-shot command against a real redis-server that refuses its URL's credentials:
UNAUTHENTICATED said naming the flag, never the password; the right password works."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.cli.main import main
from tests.support.processes import free_port, start_redis, stop_process

PASSWORD = "right-one-not-shown"


@pytest.fixture(scope="module")
def guarded_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    port = free_port()
    proc = start_redis(tmp_path_factory.mktemp("redis"), port, extra=["--requirepass", PASSWORD])
    try:
        yield port
    finally:
        stop_process(proc)


def test_wrong_credentials_are_said_naming_the_flag_without_the_password(
    guarded_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"redis://:wrong-not-shown@127.0.0.1:{guarded_port}/0"
    assert main(["index", "generations", "--redis-url", url]) == 2
    err = capsys.readouterr().err
    assert f"--redis-url: Redis at redis://:***@127.0.0.1:{guarded_port}/0 refused the " in err
    assert "credentials" in err
    assert "not-shown" not in err


def test_the_right_password_reaches_the_store(
    guarded_port: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"redis://:{PASSWORD}@127.0.0.1:{guarded_port}/0"
    assert main(["redis", "layout", "--shards", "2", "--redis-url", url]) == 0
    assert "layout version" in capsys.readouterr().out
