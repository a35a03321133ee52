"""``gtr-retrieval up --query-cache``: the flags reach the gateway child, and the
gateway's own settings parser (what the child runs) reads them as the cache turned on."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.cli.main import build_parser
from services.gateway.settings import GatewaySettings
from services.rpc.settings import load_settings
from services.stack.components import gateway_child, write_secret
from services.stack.config import StackConfig
from services.stack.endpoints import Endpoints


def gateway_settings(cfg: StackConfig) -> GatewaySettings:
    write_secret(cfg.redis_url_file, "redis://127.0.0.1:6390/0\n")  # as redis_child does
    endpoints = Endpoints(redis_url="redis://127.0.0.1:6390/0", shards=[["127.0.0.1:7001"]])
    child, _ = gateway_child(cfg, endpoints)
    serve = child.argv.index("serve")
    assert child.argv[serve - 1] == "gateway"
    return load_settings(GatewaySettings, child.argv[serve + 1 :], prog="gateway serve")


def test_up_query_cache_turns_on_the_gateways_cache(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        [
            "up",
            "--run-dir",
            str(tmp_path),
            "--query-cache",
            "--query-cache-ttl-s",
            "120",
            "--query-cache-max-entries",
            "777",
        ]
    )
    cfg = StackConfig(
        run_dir=tmp_path,
        encoder="inprocess",
        gateway_port=50999,
        query_cache=args.query_cache,
        query_cache_ttl_s=args.query_cache_ttl_s,
        query_cache_max_entries=args.query_cache_max_entries,
    )
    settings = gateway_settings(cfg)
    assert settings.query_cache
    assert settings.query_cache_ttl_s == 120.0 and settings.query_cache_max_entries == 777
    assert settings.query_cache_redis_url is None  # the stack's Redis (--redis-url-file)
    assert settings.redis_url == "redis://127.0.0.1:6390/0"


def test_without_the_flag_the_cache_stays_off(tmp_path: Path) -> None:
    args = build_parser().parse_args(["up", "--run-dir", str(tmp_path)])
    assert not args.query_cache
    cfg = StackConfig(run_dir=tmp_path, encoder="inprocess", gateway_port=50999)
    assert not gateway_settings(cfg).query_cache


def test_up_help_names_the_query_cache(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--help"])
    text = capsys.readouterr().out
    assert "--query-cache " in text and "--query-cache-max-entries" in text


@pytest.mark.parametrize("flag", ["--query-cache-ttl-s", "--query-cache-max-entries"])
def test_up_refuses_cache_flags_without_the_cache(flag: str, tmp_path: Path) -> None:
    """Said once and plainly, before anything starts, instead of silently ignored."""
    from services.cli.main import main

    with pytest.raises(SystemExit, match="add --query-cache to turn it on"):
        main(["up", "--run-dir", str(tmp_path / "run"), flag, "5"])
    assert not (tmp_path / "run").exists()
