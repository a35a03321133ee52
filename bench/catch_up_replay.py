"""What the catch-up's appends cost: a run of single-document writes in one script each
(before 2026-12-02) against runs of them in one script (``phase_catch_up._runs``).

    .venv/bin/python -m bench.catch_up_replay [--entries 2000] [--rounds 3] [--dir DIR]

Starts a real redis-server with the local stack's own command line
(``services.stack.components.redis_child``: AOF on, ``appendfsync always``), writes
``--entries`` upserts of one document each into g1's two shard logs through the real
writer (:class:`ChangeLogWriter`, one call a document: what the gateway logs for a
client's single-document upsert), 384-d unit vectors and ~600 characters of text, and
parses them as the replay does. Then, alternating round by round so that both see the
same machine, it appends all of them into a fresh target generation's logs with the
real :class:`TargetAppender`: *per entry*, one append per source entry (the replay
before), and *runs*, the replay's runs (one op, no id twice; up to
``append.SCRIPT_ITEMS`` a script). Prints each side's entries/s (best round and median)
and the ratio runs / per entry, then one JSON line. The data directory defaults to a
temporary folder in ``.run/`` (the filesystem the stack writes its AOF to)."""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.redis_writes import DIM, _records, work_dir

SHARDS = 2


def _write_source(url: str, entries: int) -> Any:
    """g1's keys, with ``entries`` single-document upserts in its logs."""
    from services.index.client.connection import StoreConnection
    from services.index.client.writer import ChangeLogWriter
    from services.index.keys import LAYOUT_KEY, GenerationKeys, Layout
    from services.process.redis_client import sync_client

    client = sync_client(url)
    client.hset(LAYOUT_KEY, mapping={"version": "2", "shards": str(SHARDS)})
    client.close()
    source = GenerationKeys("g1", Layout(2, SHARDS))
    records = _records(np.random.default_rng(0), entries, "c")

    async def write() -> None:
        writer = ChangeLogWriter(StoreConnection(url, source.layout.base), DIM, keys=source)
        try:
            for record in records:
                await writer.upsert([record])
        finally:
            await writer.connection.close()

    asyncio.run(write())
    return source


def _parsed(client: Any, source: Any) -> list[list[Any]]:
    """Each shard's entries as the replay parses them (the entries carry their vectors)."""
    from services.generations.phase_catch_up import _parse_entry

    return [
        [_parse_entry(fields, True, "") for _, fields in client.xrange(source.log(shard))]
        for shard in range(SHARDS)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=2000, help="single-document upserts")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per side")
    parser.add_argument("--dir", type=Path, default=None, help="where the AOF goes (.run/)")
    args = parser.parse_args(argv)

    from services.generations.append import TargetAppender
    from services.generations.phase_catch_up import _append_runs, _runs
    from services.index.keys import GenerationKeys, Layout
    from services.process.redis_client import sync_client
    from services.stack import components
    from services.stack.config import StackConfig

    base = work_dir(args.dir, "bench-catch-up-replay-")
    cfg = StackConfig(run_dir=base / "run")
    child = components.redis_child(cfg)
    child.start()
    try:
        child.wait_ready(lambda: components.redis_ready(child), 30)
        source = _write_source(child.address, args.entries)
        client = sync_client(child.address)
        shards = _parsed(client, source)
        seconds: dict[str, list[float]] = {"per_entry": [], "runs": []}
        for n in range(args.rounds):
            for side in seconds:
                target = GenerationKeys(f"g{2 + 2 * n + (side == 'runs')}", Layout(2, SHARDS))
                appender = TargetAppender(client, target, copy_documents=False)
                if side == "runs":
                    work = [_runs(parsed, set()) for parsed in shards]
                else:
                    work = [_runs([entry], set()) for parsed in shards for entry in parsed]

                started = time.perf_counter()
                for runs in work:
                    _append_runs(appender, runs)
                seconds[side].append(time.perf_counter() - started)
                logged = sum(client.xlen(target.log(s)) for s in range(SHARDS))
                print(f"round {n + 1} {side}: {seconds[side][-1]:.2f} s, {logged} target entries")
        client.close()
        rates = {
            side: {
                "best_entries_per_s": round(args.entries / min(times), 1),
                "median_entries_per_s": round(args.entries / statistics.median(times), 1),
            }
            for side, times in seconds.items()
        }
        ratio = round(min(seconds["per_entry"]) / min(seconds["runs"]), 2)
        print(
            f"per entry {rates['per_entry']['best_entries_per_s']} entries/s, runs "
            f"{rates['runs']['best_entries_per_s']} entries/s (best of {args.rounds}): "
            f"{ratio}x"
        )
        print(
            json.dumps(
                {
                    "bench": "catch_up_replay",
                    "entries": args.entries,
                    "rounds": args.rounds,
                    "dim": DIM,
                    "seconds": seconds,
                    "rates": rates,
                    "runs_over_per_entry": ratio,
                }
            )
        )
        return 0
    finally:
        child.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    from services.stack.children import sigterm_as_interrupt

    with sigterm_as_interrupt():  # SIGTERM (a `timeout`) stops the Redis server too
        sys.exit(main())
