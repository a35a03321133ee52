"""services.cli.common.config_from_args: a command's dataclass config from its flags."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.cli.common import config_from_args
from services.cli.main import build_parser


@dataclass(frozen=True)
class _Config:
    data_dir: Path
    depth: int = 100
    progress: bool = True
    seed: int = 13


def test_a_field_takes_the_flag_of_its_name_and_an_explicit_value_wins() -> None:
    args = argparse.Namespace(data="d", depth=7, seed=5, quiet=True, command="x")
    cfg = config_from_args(_Config, args, data_dir=Path(args.data), seed=1)
    assert cfg == _Config(data_dir=Path("d"), depth=7, progress=True, seed=1)


def test_a_field_no_flag_names_keeps_the_class_default() -> None:
    cfg = config_from_args(_Config, argparse.Namespace(), data_dir=Path("d"))
    assert (cfg.depth, cfg.progress, cfg.seed) == (100, True, 13)


def test_an_explicit_value_for_no_field_is_refused() -> None:
    with pytest.raises(TypeError, match="_Config has no field timeout_s"):
        config_from_args(_Config, argparse.Namespace(), data_dir=Path("d"), timeout_s=3.0)


def test_up_passes_every_flag_into_the_stack_config() -> None:
    """The real parser and config: a flag renamed on one side only would keep its default
    here, so each one is set to something other than its default and read back."""
    from services.stack.config import StackConfig

    argv = [
        "up",
        "--corpus",
        "c.jsonl",
        "--run-dir",
        "r",
        "--shards",
        "3",
        "--replicas",
        "2",
        "--encoder",
        "inprocess",
        "--rerank-checkpoint",
        "ck",
        "--port",
        "0",
        "--redis-fsync",
        "everysec",
        "--auth",
        "--tls",
        "--query-cache",
        "--query-cache-ttl-s",
        "3",
        "--query-cache-max-entries",
        "4",
        "--rerank-checkpoint-dir",
        "ckpts",
    ]
    args = build_parser().parse_args(argv)
    cfg = config_from_args(StackConfig, args, gateway_port=args.port)
    assert (cfg.run_dir, cfg.corpus, cfg.shards, cfg.replicas, cfg.encoder) == (
        Path("r"),
        Path("c.jsonl"),
        3,
        2,
        "inprocess",
    )
    assert (cfg.rerank_checkpoint, cfg.gateway_port, cfg.redis_fsync) == (Path("ck"), 0, "everysec")
    assert (cfg.auth, cfg.tls, cfg.query_cache) == (True, True, True)
    assert (cfg.query_cache_ttl_s, cfg.query_cache_max_entries) == (3.0, 4)
    assert cfg.rerank_checkpoint_dir == Path("ckpts")
    from services.stack.components import rerank_child

    argv_of_rerank = rerank_child(cfg).argv
    assert argv_of_rerank[argv_of_rerank.index("--checkpoint-dir") + 1] == "ckpts"


def test_up_defaults_to_an_admission_limit_derived_from_the_cpus_it_may_use() -> None:
    """Issue #33 point 4: without --max-in-flight ``up``'s gateway and shards get 16
    units per CPU of ``os.sched_getaffinity`` (never 0, no limit); ``--max-in-flight 0``
    turns it off, a number sets it."""
    import os

    from services.cli.stack_commands import stack_config
    from services.stack import components
    from services.stack.config import IN_FLIGHT_PER_CORE
    from services.stack.endpoints import Endpoints

    parser = build_parser()
    cpus = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(cpus)})
        assert stack_config(parser.parse_args(["up"])).max_in_flight == IN_FLIGHT_PER_CORE
    finally:
        os.sched_setaffinity(0, cpus)
    cfg = stack_config(parser.parse_args(["up"]))
    assert cfg.max_in_flight == IN_FLIGHT_PER_CORE * len(cpus) > 0
    gateway, _ = components.gateway_child(cfg, Endpoints())
    shard = components.shard_child(cfg, 0, 0)
    for child in (gateway, shard):
        flag = child.argv.index("--max-in-flight")
        assert child.argv[flag + 1] == str(cfg.max_in_flight), child.argv
    assert stack_config(parser.parse_args(["up", "--max-in-flight", "0"])).max_in_flight == 0
    assert stack_config(parser.parse_args(["up", "--max-in-flight", "7"])).max_in_flight == 7
    with pytest.raises(SystemExit):
        stack_config(parser.parse_args(["up", "--max-in-flight", "-1"]))


def test_up_forks_its_shard_processes_unless_told_not_to() -> None:
    from services.cli.stack_commands import stack_config

    parser = build_parser()
    assert stack_config(parser.parse_args(["up"])).fork_shards is True
    assert stack_config(parser.parse_args(["up", "--no-fork-shards"])).fork_shards is False
