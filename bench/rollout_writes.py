"""What ``bench.rollout`` checks of the writes made during a rollout (issue #33 point 2):
that none acknowledged is lost, and how many log entries carried the target's vectors.
The source's logs are held from before the rollout (:func:`hold_source`): after the
switch its shards would trim the entries the check reads.

*Lost*: every upsert or delete the source generation acknowledged after P0 (its write
token names the source; it is in the source's log at the token's position, and the
entry there gives its version) must be covered in the target: the target's ``lv`` hash
(the newest version the builder appended for the id, bulk or replay) holds that version
or a newer one. Writes acknowledged before P0 reach the target through the bulk pass's
SCAN of the documents instead, and writes the target acknowledged itself (after the
switch) are in its logs by construction: neither is counted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from services.common import positions
from services.generations import logs
from services.generations.registry import Registry


@dataclass
class WriteCheck:
    checked: int  # acknowledged writes of the source after P0
    lost: list[str]  # "id@version" of those the target does not hold


HOLD = "bench:writes"


def hold_source(client: Any) -> str:
    """Keep the serving generation's shards from trimming its logs (a registration like
    a replica's, at 0-0, without heartbeat: never stale) so that :func:`check_writes` can
    read every write's entry after the switch, when the rollout's own hold is gone and
    the previous generation's shards trim; the generation's name."""
    registry = Registry(client)
    serving = registry.serving()
    keys = registry.keys(serving)
    logs.hold(client, keys, {s: positions.ZERO for s in range(keys.num_shards)}, HOLD, False)
    return serving.name


def _version_at(client: Any, key: str, position: str, doc_id: str) -> int | None:
    """The version the entry at ``position`` of ``key`` gave ``doc_id``."""
    entries = client.xrange(key, position, position)
    if not entries:
        return None
    fields = entries[0][1]
    ids = json.loads(fields[b"ids"])
    vers = json.loads(fields[b"vers"])
    return int(vers[ids.index(doc_id)]) if doc_id in ids else None


def check_writes(
    client: Any, writes: list[Any], source: str, target: str, after: float
) -> WriteCheck:
    """:class:`WriteCheck` of the ``writes`` (tests/support/steady_load.py ``WriteOp``)
    acknowledged by ``source`` that started at or after ``after`` (P0 recorded)."""
    registry = Registry(client)
    src = registry.keys(registry.get(source))
    tgt = registry.keys(registry.get(target))
    checked, lost = 0, []
    for op in writes:
        if not op.ok or op.generation != source or op.start < after:
            continue
        if not op.positions:  # a delete of nothing logs nothing
            continue
        ((shard, position),) = op.positions.items()
        version = _version_at(client, src.log(shard), position, op.doc_id)
        if version is None:
            lost.append(f"{op.doc_id}@? (not in {src.log(shard)} at {position})")
            continue
        checked += 1
        held = client.hget(tgt.logged(tgt.layout.shard(op.doc_id)), op.doc_id)
        if held is None or int(held) < version:
            lost.append(f"{op.doc_id}@{version}")
    return WriteCheck(checked, lost)


def dual_counts(client: Any, source: str, p0: dict[int, str]) -> dict[str, int]:
    """Upsert entries of ``source``'s logs after ``p0``: with the target's vectors (the
    dual write) and without."""
    registry = Registry(client)
    src = registry.keys(registry.get(source))
    out = {"upsert_entries": 0, "with_target_vectors": 0}
    for shard, start in p0.items():
        first = f"({start}" if start != positions.ZERO else "-"
        for _, fields in client.xrange(src.log(shard), first):
            if fields[b"op"] != b"u":
                continue
            out["upsert_entries"] += 1
            out["with_target_vectors"] += int(bool(fields.get(b"tenc")))
    return out


def dual_encode_outcomes(metrics_address: str) -> dict[str, float]:
    """The gateway's ``gateway_generation_dual_encodes_total`` by outcome (encoded,
    late, failed), read from its /metrics at ``host:port``; {} when it has none yet."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5) as reply:
        text = reply.read().decode("utf-8")
    return {
        sample.labels["outcome"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "gateway_generation_dual_encodes"
        for sample in family.samples
        if sample.name.endswith("_total")
    }


__all__ = ["WriteCheck", "check_writes", "dual_counts", "dual_encode_outcomes", "hold_source"]
