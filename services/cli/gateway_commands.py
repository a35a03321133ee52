"""``gtr-retrieval gateway serve``: run the public gateway."""

from __future__ import annotations

from typing import Any

from services.cli.serve import add_serve


def add_cli(sub: Any) -> None:
    gateway = sub.add_parser("gateway", help="The public gRPC gateway.")
    actions = gateway.add_subparsers(dest="gateway_command", metavar="ACTION", required=True)
    add_serve(
        actions,
        help="Run the gateway (SearchService + DocumentService).",
        description="All settings come from GTR_GATEWAY_* environment variables or the "
        "flags below (flags win). Example: gtr-retrieval gateway serve --shards "
        "127.0.0.1:50061;127.0.0.1:50062 --redis_url redis://127.0.0.1:6379/0",
        main="services.gateway.server:main",
    )
