"""``gtr-retrieval gateway serve``: run the public gateway."""

from __future__ import annotations

import argparse
from typing import Any


def add_cli(sub: Any) -> None:
    gateway = sub.add_parser("gateway", help="The public gRPC gateway.")
    gsub = gateway.add_subparsers(dest="gateway_command", metavar="ACTION", required=True)
    serve = gsub.add_parser(
        "serve",
        help="Run the gateway (SearchService + DocumentService).",
        description="All settings come from GTR_GATEWAY_* environment variables or the "
        "flags below (flags win). Example: gtr-retrieval gateway serve --shards "
        "127.0.0.1:50061;127.0.0.1:50062 --redis_url redis://127.0.0.1:6379/0",
        add_help=False,
    )
    serve.set_defaults(handler=_serve, passthrough=True)


def _serve(args: argparse.Namespace) -> int:
    from services.gateway.server import main

    return main(args.settings)
