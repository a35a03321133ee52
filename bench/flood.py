"""One client's tiny-deadline flood and the others' searches (issue #33 point 1): the share
of ordinary searches that fail beside the flood, on a gateway without the containment and
on the gateway as it starts by default, measured in one run.

    .venv/bin/python -m bench.flood [--seconds 8] [--rounds 2] [--docs 2000]
        [--flood-concurrency 64] [--flood-deadline-ms 5]

One real stack (bench/gateway_pair.py's: a redis-server, one index shard process, SciFact
documents ingested) and two gateway processes on it, with the in-process encoder and
``up``'s admission limit for this machine, differing only in the containment:

- ``uncontained``: ``--max-streams-per-connection 2147483647 --client-share 1`` (what the
  gateway did before: as many streams per connection as gRPC allows, no share);
- ``contained``: the defaults (max(128, 2 x the limit) streams per connection, a client's
  share of half the limit under load).

Per round and gateway: one flood process (``--flood-concurrency`` searches at a time over
one channel, each with a ``--flood-deadline-ms`` deadline, no retries) and one process of
4 ordinary search loops (a 2 s deadline, 20 ms between calls, no retries) for
``--seconds`` (tests/support/flood.py). Printed: the others' failure share and searches/s,
and the flood's codes; ``others_failed_ratio`` (contained ÷ uncontained failure share,
over all rounds). A ``--bare`` run adds the same against a grpc.aio server with none of
our code (a handler that sleeps 3 ms), with and without ``grpc.max_concurrent_streams``,
to show the cause is below our handlers. One JSON line last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from bench import gateway_pair as pair

UNCONTAINED = ["--max-streams-per-connection", "2147483647", "--client-share", "1"]


def _round(address: str, args: Any) -> dict[str, Any]:
    from tests.support.flood import run_clients

    flood, others = run_clients(
        address,
        args.seconds,
        flood_concurrency=args.flood_concurrency,
        flood_deadline_ms=args.flood_deadline_ms,
    )
    return {
        "others_calls": others.calls,
        "others_failed": others.failed,
        "others_codes": others.codes,
        "others_per_s": others.calls_per_s,
        "flood_per_s": flood.calls_per_s,
        "flood_codes": flood.codes,
    }


def _summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    calls = sum(r["others_calls"] for r in rounds)
    failed = sum(r["others_failed"] for r in rounds)
    return {
        "others_calls": calls,
        "others_failed": failed,
        "others_failed_share": round(failed / calls, 4) if calls else None,
        "rounds": rounds,
    }


async def _bare_server(port_queue: Any, options: list[tuple[str, int]]) -> None:
    import grpc

    async def unary(request: bytes, context: Any) -> bytes:
        await asyncio.sleep(0.003)
        return request

    server = grpc.aio.server(options=options)
    handler = grpc.method_handlers_generic_handler(
        "retrieval.v1.SearchService",
        {"Search": grpc.unary_unary_rpc_method_handler(unary)},
    )
    server.add_generic_rpc_handlers((handler,))
    port_queue.put(server.add_insecure_port("127.0.0.1:0"))
    await server.start()
    await server.wait_for_termination()


def _serve_bare(port_queue: Any, options: list[tuple[str, int]]) -> None:
    asyncio.run(_bare_server(port_queue, options))


@contextmanager
def bare(options: list[tuple[str, int]]) -> Iterator[str]:
    """A bare grpc.aio server (the Search method's name, a 3 ms sleep) in a process."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_serve_bare, args=(queue, options), daemon=True)
    proc.start()
    try:
        yield f"127.0.0.1:{queue.get(timeout=60)}"
    finally:
        proc.kill()
        proc.join()


def _print(name: str, summary: dict[str, Any]) -> None:
    last = summary["rounds"][-1]
    print(
        f"{name:<22} others failed {summary['others_failed']}/{summary['others_calls']} "
        f"({summary['others_failed_share']:.1%})   flood {last['flood_per_s']:.0f}/s "
        f"{last['flood_codes']}",
        flush=True,
    )


def _gateways(args: Any, work: Any) -> dict[str, dict[str, Any]]:
    from services.stack.config import default_max_in_flight
    from tests.support.processes import free_port

    data = pair.load_scifact(args.docs)
    index_dir = pair.train(data, work)
    limit = ["--max-in-flight", str(default_max_in_flight()), "--no-auth"]
    results: dict[str, list[dict[str, Any]]] = {"uncontained": [], "contained": []}
    with pair.one_shard(index_dir, data, work) as (store, shard_proc):
        addresses = {name: f"127.0.0.1:{free_port()}" for name in results}
        argv = {
            name: [*pair.gateway_argv(store.url, shard_proc.address, address), *limit]
            for name, address in addresses.items()
        }
        argv["uncontained"] += UNCONTAINED
        with (
            pair.process(argv["uncontained"], work / "uncontained.log") as proc_u,
            pair.process(argv["contained"], work / "contained.log") as proc_c,
        ):
            for name, proc in (("uncontained", proc_u), ("contained", proc_c)):
                pair.wait_healthy(addresses[name], proc, work / f"{name}.log", name)
            for _ in range(args.rounds):
                for name in results:
                    results[name].append(_round(addresses[name], args))
    return {name: _summary(rounds) for name, rounds in results.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--docs", type=int, default=2000)
    parser.add_argument("--flood-concurrency", type=int, default=64)
    parser.add_argument("--flood-deadline-ms", type=float, default=5.0)
    parser.add_argument("--bare", action="store_true", help="also a bare grpc.aio server")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    pair.check_prerequisites()
    result: dict[str, Any] = {}
    if args.bare:
        for name, options in (
            ("bare_uncontained", []),
            ("bare_contained", [("grpc.max_concurrent_streams", 512)]),
        ):
            with bare(options) as address:
                result[name] = _summary([_round(address, args) for _ in range(args.rounds)])
            _print(name, result[name])
    with pair.work_dir("bench-flood-", args.keep) as work:
        result |= _gateways(args, work)
    for name in ("uncontained", "contained"):
        _print(name, result[name])
    before, after = (result[n]["others_failed_share"] for n in ("uncontained", "contained"))
    result["others_failed_ratio"] = round(after / before, 4) if before else None
    line = json.dumps({"bench": "flood", **vars(args), **result})
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
