"""What ``appendfsync always`` costs the upsert path, against ``everysec``.

    .venv/bin/python -m bench.redis_fsync [--seconds 3] [--rounds 2] [--batches 1,32]
        [--concurrency 1,16] [--dir DIR]

Starts two real redis-server processes with the local stack's own command line
(``services.stack.components.redis_child``: AOF on, RDB off), one with
``--appendfsync always`` (the stack's default: an acknowledged upsert is on disk) and
one with ``everysec`` (the last second of writes can be lost on a power loss or kernel
crash). Then, for every batch size and concurrency, it drives the project's real write
path, :meth:`ChangeLogWriter.upsert` (one Lua script: HSET of each document and XADD
to its shard's log, 2 shards), with random unit vectors of dimension 384 and ~600
characters of text per document, alternating the two servers round by round so that
both see the same machine. Per cell it reports upserts/s, documents/s and the latency
percentiles of one upsert call, then the ratio always / everysec. The data directories
default to a temporary folder in the stack's default run directory ``.run/``, so on the
filesystem the stack writes its AOF to (fsync on a tmpfs would cost nothing). Prints
one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys

from bench.redis_writes import DIM, SHARDS, Side, add_arguments, compare, work_dir

POLICIES = ("always", "everysec")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)

    from services.stack import components
    from services.stack.children import Child
    from services.stack.config import StackConfig

    base = work_dir(args.dir, "bench-redis-fsync-")
    servers: dict[str, Child] = {}
    try:
        for policy in POLICIES:
            cfg = StackConfig(run_dir=base / policy, redis_fsync=policy)  # type: ignore[arg-type]
            child = components.redis_child(cfg)
            child.start()
            child.wait_ready(lambda c=child: components.redis_ready(c), 30)  # type: ignore[misc]
            servers[policy] = child
        results, ratio = compare(
            {policy: Side(policy, servers[policy].address) for policy in POLICIES}, args
        )
        print(
            json.dumps(
                {
                    "bench": "redis_fsync",
                    "dim": DIM,
                    "shards": SHARDS,
                    "seconds": args.seconds,
                    "rounds": args.rounds,
                    "filesystem_dir": str(base),
                    "results": results,
                    "throughput_ratio_always_over_everysec": ratio,
                }
            )
        )
        return 0
    finally:
        for child in servers.values():
            child.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    from services.stack.children import sigterm_as_interrupt

    with sigterm_as_interrupt():  # SIGTERM (a `timeout`) stops the Redis servers too
        sys.exit(main())
