"""Redis URLs: one Redis or a Redis Cluster, credentials and TLS options, clear refusals."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.gateway.settings import GatewaySettings
from services.index.server.settings import ShardSettings
from services.process.redis_client import async_client, is_cluster, parse_redis_url, sync_client


def test_a_single_redis_url_is_one_server() -> None:
    target = parse_redis_url("redis://:pw@h:6379/2")
    assert not target.cluster and target.safe_url == "redis://:***@h:6379/2"
    assert not is_cluster(sync_client("redis://127.0.0.1:1/0"))


def test_a_cluster_url_names_its_seed_nodes_credentials_and_tls() -> None:
    target = parse_redis_url(
        "rediss+cluster://app:s%40cret@n1.example:7000,n2.example:7001/?ssl_cert_reqs=none"
    )
    assert target.cluster
    assert target.nodes == (("n1.example", 7000), ("n2.example", 7001))
    assert target.options["username"] == "app" and target.options["password"] == "s@cret"
    assert target.options["ssl"] is True and target.options["ssl_cert_reqs"] == "none"
    assert "s%40cret" not in target.safe_url and "***" in target.safe_url
    plain = parse_redis_url("redis+cluster://127.0.0.1:7000")
    assert plain.nodes == (("127.0.0.1", 7000),) and "ssl" not in plain.options
    assert is_cluster(async_client("redis+cluster://127.0.0.1:1"))  # connects on first use


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://h:1", "the scheme must be"),
        ("h:6379", "the scheme must be"),
        ("redis+cluster://h1:7000,h2", "is not host:port"),
        ("redis+cluster://h1:port", "is not host:port"),
        ("redis+cluster://h1:7000/3", "only database 0"),
    ],
)
def test_a_bad_url_is_refused_at_start_with_the_reason(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_redis_url(url)
    with pytest.raises(ValidationError, match=message):
        GatewaySettings(shards="127.0.0.1:1", redis_url=url)
    with pytest.raises(ValidationError, match=message):
        ShardSettings(shard=0, shards=1, index_dir="i", snapshot_dir="s", redis_url=url)


def test_a_gateway_whose_redis_never_answers_gives_up_with_a_clear_error() -> None:
    from services.common.errors import Unavailable
    from services.gateway.server import base_shard_count
    from services.index.layout import check_layout_at

    for url in ("redis://:secret@127.0.0.1:1/0", "redis+cluster://:secret@127.0.0.1:1"):
        with pytest.raises(Unavailable, match="cannot be reached to check its key layout") as e:
            check_layout_at(url, 2, wait_s=0)
        assert "secret" not in str(e.value) and ":***@127.0.0.1:1" in str(e.value)
        settings = GatewaySettings(redis_url=url, auth=False)
        with pytest.raises(Unavailable, match="cannot be reached to read the base shard count"):
            base_shard_count(settings, wait_s=0)


def test_wait_settings_of_the_writer_are_checked() -> None:
    from services.index.client.writer import ChangeLogWriter

    with pytest.raises(ValueError, match="must not be negative"):
        ChangeLogWriter.connect("redis://127.0.0.1:1/0", 1, wait_replicas=-1)
    with pytest.raises(ValueError, match="num_shards must be positive"):
        ChangeLogWriter.connect("redis://127.0.0.1:1/0", 0)
    with pytest.raises(ValidationError):
        GatewaySettings(shards="127.0.0.1:1", redis_wait_replicas=-1)
