"""``gtr-retrieval gateway serve``: run the public gateway."""

from __future__ import annotations

from typing import Any

from services.cli.common import add_group
from services.cli.serve import add_serve


def add_cli(sub: Any) -> None:
    actions = add_group(sub, "gateway", help="The public gRPC gateway.")
    add_serve(
        actions,
        help="Run the gateway (SearchService + DocumentService).",
        description="All settings come from GTR_GATEWAY_* environment variables or the "
        "flags below (flags win). Example: gtr-retrieval gateway serve --shards "
        "127.0.0.1:50061;127.0.0.1:50062 --redis_url redis://127.0.0.1:6379/0",
        main="services.gateway.server:main",
    )
