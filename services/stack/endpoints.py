"""Where the parts of a running local stack listen, and how a client reaches them.

The launcher (:mod:`services.stack.launcher`) fills it in as the children come up and
writes it to ``<run_dir>/stack.json``, which the client commands and the load tools read;
the children's command lines (:mod:`services.stack.components`) are built from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Endpoints:
    redis_url: str = ""  # without its password (the URL file holds the whole URL)
    redis_url_file: str = ""  # how to reach Redis, password and certificates included
    triton_grpc: str = ""
    triton_metrics: str = ""
    shards: list[list[str]] = field(default_factory=list)
    rerank: str = ""
    gateway: str = ""
    gateway_metrics: str = ""
    prometheus: str = ""
    # how a client reaches the gateway: token files (`up --auth`), the CA to trust
    # (`up --tls`); the CLI reads them from stack.json
    read_tokens_file: str = ""
    write_tokens_file: str = ""
    client_tls: dict[str, str] = field(default_factory=dict)
    # how our own services reach each other under `up --tls` (mTLS: the run's CA and
    # client certificate); the load tools use it to reach Triton directly
    internal_tls: dict[str, str] = field(default_factory=dict)

    def as_json(self) -> dict[str, object]:
        return dict(vars(self))
