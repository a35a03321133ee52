"""One client flooding a gateway with tiny-deadline searches, and ordinary clients searching
beside it: each a process of its own (``python -m tests.support.flood``), as on a real
machine, printing what its calls ended with as one JSON line.

- ``flood``: ``--concurrency`` searches at a time over one channel, each with a
  ``--deadline-ms`` deadline, for ``--seconds``; no retries.
- ``search``: ``--concurrency`` loops of one ordinary search (a 2 s deadline) then a
  ``--pause-ms`` pause, over one channel of their own; no retries either, so every
  failure counts.

:func:`run_clients` starts a flood and the ordinary searches together and returns both
tallies (``codes``: status code name → calls; ``failed``: calls not OK).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import grpc

from retrieval.v1 import search_pb2, search_pb2_grpc

QUERIES = ("read a csv file", "parse json", "sort a list", "open a socket", "join paths")


@dataclass(frozen=True)
class Tally:
    codes: dict[str, int]
    calls_per_s: float

    @property
    def calls(self) -> int:
        return sum(self.codes.values())

    @property
    def failed(self) -> int:
        return self.calls - self.codes.get("OK", 0)


async def _loop(
    stub: search_pb2_grpc.SearchServiceStub,
    codes: collections.Counter[str],
    end: float,
    deadline_s: float,
    pause_s: float,
    n: int,
) -> None:
    i = n
    while time.monotonic() < end:
        request = search_pb2.SearchRequest(query=QUERIES[i % len(QUERIES)], k=3)
        i += 1
        try:
            await stub.Search(request, timeout=deadline_s, wait_for_ready=False)
            codes["OK"] += 1
        except grpc.aio.AioRpcError as exc:
            codes[exc.code().name] += 1
        if pause_s:
            await asyncio.sleep(pause_s)


async def clients(
    address: str, seconds: float, concurrency: int, deadline_s: float, pause_s: float
) -> Tally:
    """``concurrency`` search loops over one channel (retries off) for ``seconds``."""
    codes: collections.Counter[str] = collections.Counter()
    options = [("grpc.enable_retries", 0), ("grpc.use_local_subchannel_pool", 1)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        await asyncio.wait_for(channel.channel_ready(), 30)
        stub = search_pb2_grpc.SearchServiceStub(channel)
        start = time.monotonic()
        end = start + seconds
        await asyncio.gather(
            *(_loop(stub, codes, end, deadline_s, pause_s, n) for n in range(concurrency))
        )
        elapsed = time.monotonic() - start
    return Tally(dict(codes), round(sum(codes.values()) / elapsed, 1))


def _command(mode: str, address: str, seconds: float, concurrency: int, **extra: Any) -> list[str]:
    args = [sys.executable, "-m", "tests.support.flood", mode, address]
    args += ["--seconds", str(seconds), "--concurrency", str(concurrency)]
    for key, value in extra.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    return args


def run_clients(
    address: str, seconds: float, *, flood_concurrency: int = 64, flood_deadline_ms: float = 5.0
) -> tuple[Tally, Tally]:
    """A flood and 4 ordinary search loops against ``address`` for ``seconds``, each in a
    process of its own: (the flood's tally, the ordinary searches' tally)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    flood = subprocess.Popen(
        _command("flood", address, seconds, flood_concurrency, deadline_ms=flood_deadline_ms),
        stdout=subprocess.PIPE,
        env=env,
    )
    others = subprocess.Popen(
        _command("search", address, seconds, 4, pause_ms=20), stdout=subprocess.PIPE, env=env
    )
    results = []
    for name, proc in (("flood", flood), ("search", others)):
        out, _ = proc.communicate(timeout=seconds + 120)
        if proc.returncode != 0:
            raise RuntimeError(f"the {name} client ended {proc.returncode}")
        data = json.loads(out.decode().strip().splitlines()[-1])
        results.append(Tally(data["codes"], data["calls_per_s"]))
    return results[0], results[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["flood", "search"])
    parser.add_argument("address")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--deadline-ms", type=float, default=5.0, help="flood: each call's")
    parser.add_argument("--pause-ms", type=float, default=20.0, help="search: between calls")
    args = parser.parse_args(argv)
    if args.mode == "flood":
        tally = asyncio.run(
            clients(args.address, args.seconds, args.concurrency, args.deadline_ms / 1000, 0.0)
        )
    else:
        tally = asyncio.run(
            clients(args.address, args.seconds, args.concurrency, 2.0, args.pause_ms / 1000)
        )
    print(json.dumps({"codes": tally.codes, "calls_per_s": tally.calls_per_s}), flush=True)


if __name__ == "__main__":
    main()
