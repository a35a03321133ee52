"""How a generation's shard replicas are named: ``a:1,a:2;b:1`` (issue #32: the gateway, the
rollout builder and the drift watcher all read this form, so it lives with the index's
clients, below all three)."""

from __future__ import annotations

from services.rpc.discovery import parse_addresses


def parse_shard_addresses(spec: str) -> list[list[str]]:
    """ "a:1,a:2;b:1" → [["a:1", "a:2"], ["b:1"]]: shards split by ';', replicas by ','.

    A shard may instead be one DNS target, ``dns:///name:port`` (or
    ``dns://dns-server[:port]/name:port``): its replicas are the addresses the name
    resolves to, resolved again while the gateway runs (the chart's headless Service).
    """
    parts = spec.split(";")
    if any(not part.strip(" ,") for part in parts):
        raise ValueError("expected 'host:port[,host:port...][;host:port...]', one group per shard")
    return [parse_addresses(part, "a shard") for part in parts]
