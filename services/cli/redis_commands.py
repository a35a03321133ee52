"""``gtr-retrieval redis layout|migrate``: the key layout of the document store."""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Any

from services.cli.common import add_group, reachable_store, run_handler


def add_cli(sub: Any) -> None:
    rsub = add_group(
        sub, "redis", help="The Redis document store and change logs: key layout, migration."
    )
    url_help = (
        "redis://host:port/0 (one Redis) or redis+cluster://host:port,host:port "
        "(a Redis Cluster); rediss:// and rediss+cluster:// with TLS"
    )

    layout = rsub.add_parser(
        "layout",
        help="Print the key layout recorded in the store (gtr:layout).",
        description="Prints the recorded layout version and shard count; exits 1 when the "
        "services would refuse to start on the store (an old layout, an unfinished "
        "migration, another shard count), with the reason.",
    )
    _add_redis_url(layout, url_help)
    layout.add_argument("--shards", type=int, required=True, help="The index's shard count.")
    layout.set_defaults(handler=functools.partial(run_handler, _layout))

    migrate = rsub.add_parser(
        "migrate",
        help="Rewrite a store of key layout 1 (doc:<id>, log:<s>) into layout 2 "
        "(doc:{s}:<id>, log:{s}: one hash slot per shard, Redis Cluster ready).",
        description="Run it with the gateway and the shards stopped (they refuse to start "
        "until it has finished). It is idempotent (a migrated store is left as it is) and "
        "resumable (interrupted, run it again). --shards must be the shard count the store "
        "was written with: every document's new key carries its shard. Keys are moved "
        "with DUMP/RESTORE, so stream ids and trimming state survive and the replicas "
        "resume from their snapshots.",
    )
    _add_redis_url(migrate, url_help)
    migrate.add_argument("--shards", type=int, required=True, help="The index's shard count.")
    migrate.add_argument(
        "--batch", type=int, default=500, help="Documents moved per round trip (500)."
    )
    migrate.set_defaults(handler=functools.partial(run_handler, _migrate))


def _add_redis_url(parser: argparse.ArgumentParser, url_help: str) -> None:
    """--redis-url, or --redis-url-file (a URL with a password stays out of ``ps``)."""
    from services.rpc.settings import REDIS_URL_FILE_HELP

    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--redis-url", help=url_help)
    where.add_argument("--redis-url-file", help=REDIS_URL_FILE_HELP)


def _redis_url(args: argparse.Namespace) -> str:
    """The URL given, or read from --redis-url-file (SystemExit naming a bad file)."""
    if args.redis_url_file is None:
        return str(args.redis_url)
    from services.process.redis_client import read_redis_url

    try:
        return read_redis_url(args.redis_url_file)
    except ValueError as exc:
        raise SystemExit(f"gtr-retrieval redis: {exc}") from None


def _url_flag(args: argparse.Namespace) -> str:
    """The flag the store's URL came from, for a message about it."""
    return "--redis-url" if args.redis_url_file is None else "--redis-url-file"


def _layout(args: argparse.Namespace) -> int:
    from services.common.errors import FailedPrecondition
    from services.index.layout import check_layout, read_layout

    client = reachable_store(_redis_url(args), _url_flag(args), socket_timeout=5.0)
    try:
        try:
            check_layout(client, args.shards)
        except FailedPrecondition as exc:
            print(f"gtr-retrieval redis layout: {exc.message}", file=sys.stderr)
            return 1
        layout = read_layout(client)
        print(f"layout version {layout.get('version')}, {layout.get('shards')} shards")
        return 0
    finally:
        client.close()


def _migrate(args: argparse.Namespace) -> int:
    from services.common.errors import FailedPrecondition
    from services.index.migrate import MigrationReport, migrate

    def progress(report: MigrationReport) -> None:
        print(f"  {report.documents} documents moved", file=sys.stderr, flush=True)

    client = reachable_store(_redis_url(args), _url_flag(args), socket_timeout=30.0)
    try:
        report = migrate(client, args.shards, batch=args.batch, progress=progress)
    except FailedPrecondition as exc:
        print(f"gtr-retrieval redis migrate: {exc.message}", file=sys.stderr)
        return 1
    finally:
        client.close()
    if report.already:
        print("the store has key layout 2 already: nothing to do")
    else:
        print(
            f"migrated to key layout 2: {report.documents} documents, "
            f"{report.shard_keys} logs and replica registrations ({report.keys_moved} keys)"
        )
    return 0
