"""Where the parts of a running local stack listen, and how a client reaches them.

The launcher (:mod:`services.stack.launcher`) fills it in as the children come up and
writes it to ``<run_dir>/stack.json``, which the client commands and the load tools read
(:func:`read_endpoints`); the children's command lines (:mod:`services.stack.components`)
are built from it.

What ``gtr-retrieval index rollout --run-dir`` takes from it (issue #24,
docs/generations.md): the whole Redis URL (:meth:`Endpoints.redis_url_with_secrets`: the
URL file, password and certificates included), Triton's gRPC address and its TLS
(``internal_tls``), the Triton model repository the stack serves from
(``triton_repository``: a new encoder version is published into it and loaded while
Triton serves) and ``index_root``, under which a new generation's trained index goes
(``<index_root>/<generation>``; the stack's generations supervisor starts the shards of
every generation whose record names a trained ``index_dir``, wherever it is).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

STACK_JSON = "stack.json"


@dataclass
class Endpoints:
    redis_url: str = ""  # without its password (the URL file holds the whole URL)
    redis_url_file: str = ""  # how to reach Redis, password and certificates included
    triton_grpc: str = ""
    triton_metrics: str = ""
    # the model repository Triton serves (versions of `embed` are published into it)
    triton_repository: str = ""
    # generation g1's shards (the gateway's --shards), one list of replicas per shard;
    # empty once g1 is retired (the gateway is then started without --shards)
    shards: list[list[str]] = field(default_factory=list)
    # every running generation's shards (g1's included): name -> replicas per shard,
    # as the stack also publishes them in Redis ({gtr}:addrs)
    generations: dict[str, list[list[str]]] = field(default_factory=dict)
    # where `index rollout --run-dir` puts a new generation's trained index
    index_root: str = ""
    rerank: str = ""
    gateway: str = ""
    gateway_metrics: str = ""
    # the gateway's HTTP/JSON port as a URL (https:// under `up --tls`); empty without one
    gateway_http: str = ""
    prometheus: str = ""
    # how a client reaches the gateway: token files (`up --auth`), the CA to trust
    # (`up --tls`); the CLI reads them from stack.json
    read_tokens_file: str = ""
    write_tokens_file: str = ""
    client_tls: dict[str, str] = field(default_factory=dict)
    # how our own services reach each other under `up --tls` (mTLS: the run's CA and
    # client certificate); the load tools and the rollout use it to reach Triton directly
    internal_tls: dict[str, str] = field(default_factory=dict)

    def as_json(self) -> dict[str, object]:
        return dict(vars(self))

    def redis_url_with_secrets(self) -> str:
        """The whole Redis URL (password, ``rediss://`` certificates): the URL file's."""
        if self.redis_url_file and Path(self.redis_url_file).exists():
            return Path(self.redis_url_file).read_text(encoding="utf-8").strip()
        return self.redis_url


def read_endpoints(run_dir: str | Path) -> Endpoints | None:
    """The running local stack of ``run_dir`` (its ``stack.json``), None when none runs
    there (``up`` removes the file when it stops)."""
    path = Path(run_dir) / STACK_JSON
    if not path.exists():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    known = {f.name for f in fields(Endpoints)}
    return Endpoints(**{k: v for k, v in data.items() if k in known})
