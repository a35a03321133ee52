"""``--redis-url-file``: the gateway, the shards and ``gtr-retrieval redis`` read the Redis
URL from a file (``up`` passes its password-protected Redis this way, off ``ps``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.cli.main import build_parser
from services.gateway.settings import GatewaySettings
from services.index.server.settings import ShardSettings
from services.rpc.settings import SettingsError, load_settings

SECRET_URL = "rediss://:s3cret-pw@127.0.0.1:6380/0?ssl_ca_certs=/ca.pem"
GATEWAY = ["--shards", "127.0.0.1:1", "--encoder", "inprocess", "--no-auth"]
SHARD = ["--shard", "0", "--shards", "1", "--index-dir", "i", "--snapshot-dir", "s"]


def test_the_url_in_the_file_is_the_one_used(tmp_path: Path) -> None:
    url_file = tmp_path / "redis.url"
    url_file.write_text(SECRET_URL + "\n")
    for cls, argv in ((GatewaySettings, GATEWAY), (ShardSettings, SHARD)):
        settings = load_settings(cls, [*argv, "--redis-url-file", str(url_file)])
        assert settings.redis_url == SECRET_URL, cls  # type: ignore[attr-defined]


@pytest.mark.parametrize("content", ["", "http://not-redis:1\n", "rediss+cluster://:s3cret-pw@x\n"])
def test_a_file_without_a_redis_url_is_refused_without_quoting_it(
    tmp_path: Path, content: str
) -> None:
    url_file = tmp_path / "redis.url"
    url_file.write_text(content)
    with pytest.raises(SettingsError) as refused:
        load_settings(GatewaySettings, [*GATEWAY, "--redis-url-file", str(url_file)])
    message = str(refused.value)
    assert str(url_file) in message and "first line" in message
    assert "s3cret" not in message.split("(got")[0]


def test_a_url_and_a_url_file_together_are_refused(tmp_path: Path) -> None:
    url_file = tmp_path / "redis.url"
    url_file.write_text(SECRET_URL)
    argv = [*SHARD, "--redis-url", "redis://127.0.0.1:1/0", "--redis-url-file", str(url_file)]
    with pytest.raises(SettingsError, match="not both"):
        load_settings(ShardSettings, argv)
    missing = [*SHARD, "--redis-url-file", str(tmp_path / "absent")]
    with pytest.raises(SettingsError, match="cannot read"):
        load_settings(ShardSettings, missing)


def test_the_redis_commands_take_a_url_or_a_url_file_not_both(tmp_path: Path) -> None:
    parser = build_parser()
    args = parser.parse_args(["redis", "layout", "--redis-url-file", "f", "--shards", "2"])
    assert args.redis_url_file == "f" and args.redis_url is None
    with pytest.raises(SystemExit):
        parser.parse_args(
            [
                "redis",
                "layout",
                "--redis-url",
                "redis://x:1/0",
                "--redis-url-file",
                "f",
                "--shards",
                "2",
            ]
        )
