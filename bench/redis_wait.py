"""What ``--redis-wait-replicas 1`` (WAIT for one replica after each write) costs the
upsert path, against acknowledging as soon as the primary has the write.

    .venv/bin/python -m bench.redis_wait [--seconds 3] [--rounds 2] [--batches 1,32]
        [--concurrency 1,16] [--dir DIR]

Starts a real redis-server with the local stack's own command line
(``services.stack.components.redis_child``: AOF on, ``appendfsync always``) and a second
one replicating it (``--replicaof``, same AOF policy), as a primary and its replica run
in production (there on two machines; here both share the same two cores and disk, so a
network round trip is not in the figure, only the replica's own work). Then, for every
batch size and concurrency, it drives the project's real write path,
:meth:`ChangeLogWriter.upsert` (one Lua script per call: HSET per document + XADD to
its shard's log, 2 shards), once with ``wait_replicas=0`` and once with
``wait_replicas=1`` (EVALSHA + WAIT 1 on the same connection, one round trip), with
random 384-d unit vectors and ~600 characters of text per document, alternating the two
round by round so that both see the same machine. Per cell: upserts/s, documents/s and
the latency percentiles of one upsert call, then the ratio wait ÷ no wait. The data
directories default to a temporary folder in ``.run/`` (the disk the stack writes its
AOF to). Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys

from bench.redis_writes import DIM, SHARDS, Side, add_arguments, compare, work_dir
from tests.support.redis_replica import wait_replica_synced


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)

    import redis

    from services.stack import components
    from services.stack.children import Child
    from services.stack.config import StackConfig

    base = work_dir(args.dir, "bench-redis-wait-")
    children: list[Child] = []
    try:
        primary = components.redis_child(StackConfig(run_dir=base / "primary"))
        primary.start()
        children.append(primary)
        primary.wait_ready(lambda: components.redis_ready(primary), 30)
        host, port = primary.address.split("//")[1].split("/")[0].split(":")
        replica = components.redis_child(StackConfig(run_dir=base / "replica"))
        replica.argv = [*replica.argv, "--replicaof", host, port]
        replica.start()
        children.append(replica)
        replica.wait_ready(lambda: components.redis_ready(replica), 30)
        link = redis.Redis.from_url(replica.address)
        try:
            wait_replica_synced(link)
        finally:
            link.close()

        sides = {
            "wait_1": Side("WAIT 1", primary.address, wait_replicas=1),
            "no_wait": Side("no WAIT", primary.address, wait_replicas=0),
        }
        results, ratio = compare(sides, args)
        print(
            json.dumps(
                {
                    "bench": "redis_wait",
                    "dim": DIM,
                    "shards": SHARDS,
                    "seconds": args.seconds,
                    "rounds": args.rounds,
                    "appendfsync": "always",
                    "results": results,
                    "throughput_ratio_wait_1_over_no_wait": ratio,
                }
            )
        )
        return 0
    finally:
        for child in reversed(children):
            child.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    from services.stack.children import sigterm_as_interrupt

    with sigterm_as_interrupt():  # SIGTERM (a `timeout`) stops the Redis servers too
        sys.exit(main())
