"""What index generations cost a search on a store with one generation: the gateway of this
tree against the gateway from before generations (issue #24), measured in one run.

    .venv/bin/python -m bench.generation_cost [--baseline-rev 24e53ee^] [--rounds 6]
        [--seconds 4] [--concurrency 8] [--docs 5000]

One real stack: a redis-server, one index shard process (IVF-PQ trained on the SciFact
document embeddings of ``../shared/data``, the documents ingested through the change log)
and two gateway processes on that same shard and Redis, with the in-process encoder
(all-MiniLM-L6-v2), differing only in their code:

- ``before``: the tree of ``--baseline-rev`` (default ``24e53ee^``, the commit before
  the gateway learnt generations), unpacked with ``git archive`` into the work directory;
- ``now``: this tree: every request takes its generation's parts from the cached alias
  (``GenerationSource.current()`` and a lease), the alias is re-read in the background
  every ``--alias-refresh-ms`` (500).

The client (this process, grpc.aio, ``--concurrency`` calls in flight, one channel per
gateway) sends the same SciFact queries to both in rounds that alternate before / now (the
order flips every pair; bench/gateway_pair.py's rounds, as bench.front_door's). Per call
kind (``search``: Search, k=10 in the default mode; ``get``: Get of one document):
calls/s, p50/p99 of each and ``ratio``, the median over the pairs of now ÷ before calls/s.
Beside it, from Redis's own ``INFO commandstats`` over each gateway's rounds:
``alias_reads_per_call`` (HGETALL, the alias read; 0 per search is the claim: the figure
is the background refresh's 2/s spread over the calls) and ``redis_calls_per_call`` (every
command the rounds caused, shards' log reads included). Last, ``bookkeeping_us``: what
generations add to a search's path, timed alone (best of 7), and its share of the measured
search p50: on a machine as loaded as the shared 2-core one, the round-to-round spread of
calls/s (see ``pair_ratios``) is far larger than that share, so the ratio alone cannot
show it. Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

from bench import gateway_pair as pair


def _baseline_tree(rev: str, into: Path) -> Path:
    """The source tree of ``rev`` (git archive: the repository is only read)."""
    into.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(pair.ROOT), "archive", "--format=tar", rev],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def _bookkeeping_us(repeat: int = 7, number: int = 20_000) -> dict[str, float]:
    """Microseconds per request of what generations add to the search path, measured
    alone (the best of ``repeat`` runs, so a busy machine inflates it least): the cached
    alias (``current()``), the newest token epoch of the request, the lease, and the token
    resolution, for a query without a token and for a SESSION query with one."""
    import functools
    import timeit
    from types import SimpleNamespace

    from services.gateway.domain import Consistency, SearchQuery, TokenOrigin
    from services.gateway.generation_parts import Bundle
    from services.gateway.generations import GenerationSource
    from services.gateway.pipeline import with_resolved_token

    part: Any = SimpleNamespace(model_name="m", dim=384, num_shards=1)
    source = GenerationSource.fixed(Bundle("g1", part, part, part, part, part))
    plain = [SearchQuery("q", 10)]
    session = [
        SearchQuery(
            "q",
            10,
            consistency=Consistency.SESSION,
            write_token={0: "5-1"},
            token_origin=TokenOrigin("g1", 1),
        )
    ]

    def one(queries: list[SearchQuery]) -> None:
        serving = source.current()
        max((q.token_origin.epoch for q in queries), default=0)
        with source.lease(serving):
            for q in queries:
                with_resolved_token(q, serving)

    out = {}
    for name, queries in (("eventual", plain), ("session", session)):
        best = min(timeit.repeat(functools.partial(one, queries), number=number, repeat=repeat))
        out[name] = round(best / number * 1e6, 2)
    return out


def _commandstats(client: Any) -> dict[str, int]:
    stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


def _counting(
    client: Any, into: dict[str, dict[str, int]]
) -> Callable[[str], AbstractContextManager[None]]:
    """Around one of a gateway's rounds: the Redis commands it caused, added to
    ``into[name]`` ("all", and "alias": HGETALL, the alias read)."""

    @contextmanager
    def counted(name: str) -> Iterator[None]:
        before = _commandstats(client)
        yield
        after = _commandstats(client)
        delta = {c: after[c] - before.get(c, 0) for c in after}
        delta.pop("info", None)  # the bench's own INFO
        into[name]["all"] += sum(delta.values())
        into[name]["alias"] += delta.get("hgetall", 0)

    return counted


async def _measure(
    targets: dict[str, str], client: Any, data: pair.SciFact, args: Any
) -> dict[str, Any]:
    import grpc

    channels = {name: grpc.aio.insecure_channel(address) for name, address in targets.items()}
    try:
        result: dict[str, Any] = {}
        for kind, make, over in (
            ("search", pair.search_call, data.queries),
            ("get", pair.get_call, data.ids),
        ):
            calls = {name: make(ch, over) for name, ch in channels.items()}
            redis_calls = {n: {"all": 0, "alias": 0} for n in targets}
            rounds = await pair.alternating_rounds(
                calls, args, around=_counting(client, redis_calls)
            )
            compared = pair.compare(rounds, "now", "before")
            figures = {n: compared[n] for n in targets}
            for name in targets:
                done = max(1, sum(len(latencies) for _, latencies in rounds[name]))
                figures[name]["alias_reads_per_call"] = round(redis_calls[name]["alias"] / done, 4)
                figures[name]["redis_calls_per_call"] = round(redis_calls[name]["all"] / done, 2)
            ratio = compared["ratio"]
            result[kind] = compared
            said = [
                f"{n} {f['per_s']:8.1f}/s (p50 {f['p50_ms']:.2f} ms, p99 {f['p99_ms']:.2f}, "
                f"alias reads/call {f['alias_reads_per_call']})"
                for n, f in figures.items()
            ]
            print(f"{kind:<7} {'   '.join(said)}   ratio {ratio:.3f}", flush=True)
        return result
    finally:
        for ch in channels.values():
            await ch.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-rev", default="24e53ee^", help="The code before (git rev).")
    pair.add_round_flags(parser)
    args = parser.parse_args(argv)

    import redis

    from tests.support.processes import free_port

    pair.check_prerequisites()
    with pair.work_dir("bench-generation-cost-", args.keep) as work:
        baseline = _baseline_tree(args.baseline_rev, work / "before-src")
        data = pair.load_scifact(args.docs)
        index_dir = pair.train(data, work)
        with pair.one_shard(index_dir, data, work) as (store, shard_proc):
            client = redis.Redis.from_url(store.url)
            try:
                targets = {"before": f"127.0.0.1:{free_port()}", "now": f"127.0.0.1:{free_port()}"}

                def gateway(name: str) -> list[str]:
                    argv = pair.gateway_argv(store.url, shard_proc.address, targets[name])
                    return [*argv, "--no-auth"]

                with (
                    pair.process(gateway("before"), work / "before.log", baseline) as before_proc,
                    pair.process(gateway("now"), work / "now.log") as now_proc,
                ):
                    pair.wait_healthy(targets["before"], before_proc, work / "before.log", "before")
                    pair.wait_healthy(targets["now"], now_proc, work / "now.log", "now")
                    result = asyncio.run(_measure(targets, client, data, args))
            finally:
                client.close()
    bookkeeping = _bookkeeping_us()
    share = bookkeeping["session"] / (result["search"]["now"]["p50_ms"] * 1000.0)
    print(
        f"generation bookkeeping per search: {bookkeeping} us = {share:.5%} of the search p50",
        flush=True,
    )
    print(
        pair.json_line(
            "generation_cost",
            result,
            args,
            len(data.docs),
            bookkeeping_us=bookkeeping,
            bookkeeping_share_of_search_p50=round(share, 7),
            search_alias_reads_per_call=result["search"]["now"]["alias_reads_per_call"],
            baseline_rev=args.baseline_rev,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
