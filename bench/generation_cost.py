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
order flips every pair; bench/front_door.py's rounds). Per call kind (``search``: Search,
k=10 in the default mode; ``get``: Get of one document): calls/s, p50/p99 of each and
``ratio``, the median over the pairs of now ÷ before calls/s. Beside it, from Redis's own
``INFO commandstats`` over each gateway's rounds: ``alias_reads_per_call`` (HGETALL, the
alias read; 0 per search is the claim: the figure is the background refresh's 2/s spread
over the calls) and ``redis_calls_per_call`` (every command the rounds caused, shards'
log reads included). Last, ``bookkeeping_us``: what generations add to a search's path,
timed alone (best of 7), and its share of the measured search p50: on a machine as loaded
as the shared 2-core one, the round-to-round spread of calls/s (see ``pair_ratios``) is
far larger than that share, so the ratio alone cannot show it. Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from bench.front_door import DATA, ROOT, _figures, _healthy, _ingest, _round, _wait


@contextmanager
def _process(argv: list[str], log: Path, root: Path = ROOT) -> Iterator[subprocess.Popen[bytes]]:
    """A gateway process run from the source tree ``root``."""
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _baseline_tree(rev: str, into: Path) -> Path:
    """The source tree of ``rev`` (git archive: the repository is only read)."""
    into.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", rev],
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
    from services.gateway.generations import Bundle, GenerationSource
    from services.gateway.pipeline import with_resolved_token

    part: Any = SimpleNamespace(model_name="m", dim=384, num_shards=1)
    source = GenerationSource.fixed(Bundle("g1", part, part, part, part, part))
    plain = [SearchQuery("q", 10)]
    session = [
        SearchQuery(
            "q", 10, consistency=Consistency.SESSION, write_token={0: "5-1"},
            token_origin=TokenOrigin("g1", 1),
        )
    ]  # fmt: skip

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


async def _measure(
    targets: dict[str, str], client: Any, queries: list[str], ids: list[str], args: Any
) -> dict[str, Any]:
    import grpc

    from retrieval.v1 import documents_pb2, documents_pb2_grpc, search_pb2, search_pb2_grpc

    channels = {name: grpc.aio.insecure_channel(address) for name, address in targets.items()}
    try:

        def search(ch: grpc.aio.Channel) -> Callable[[int], Any]:
            stub = search_pb2_grpc.SearchServiceStub(ch)
            return lambda i: stub.Search(
                search_pb2.SearchRequest(query=queries[i % len(queries)], k=10), timeout=30
            )

        def get(ch: grpc.aio.Channel) -> Callable[[int], Any]:
            stub = documents_pb2_grpc.DocumentServiceStub(ch)
            return lambda i: stub.Get(documents_pb2.GetRequest(id=ids[i % len(ids)]), timeout=30)

        result: dict[str, Any] = {}
        for kind, make in (("search", search), ("get", get)):
            calls = {name: make(ch) for name, ch in channels.items()}
            for name in targets:  # warm-up: connections, caches
                await _round(calls[name], args.concurrency, 1.0)
            rounds: dict[str, list[tuple[float, list[float]]]] = {n: [] for n in targets}
            redis_calls = {n: {"all": 0, "alias": 0, "calls": 0} for n in targets}
            for r in range(args.rounds):
                order = list(targets) if r % 2 == 0 else list(reversed(targets))
                for name in order:
                    before = _commandstats(client)
                    measured = await _round(calls[name], args.concurrency, args.seconds)
                    after = _commandstats(client)
                    rounds[name].append(measured)
                    delta = {c: after[c] - before.get(c, 0) for c in after}
                    delta.pop("info", None)  # the bench's own INFO
                    redis_calls[name]["all"] += sum(delta.values())
                    redis_calls[name]["alias"] += delta.get("hgetall", 0)
                    redis_calls[name]["calls"] += len(measured[1])
            figures = {n: _figures(v) for n, v in rounds.items()}
            pairs = [n[0] / b[0] for n, b in zip(rounds["now"], rounds["before"], strict=True)]
            for name in targets:
                done = max(1, redis_calls[name]["calls"])
                figures[name]["alias_reads_per_call"] = round(redis_calls[name]["alias"] / done, 4)
                figures[name]["redis_calls_per_call"] = round(redis_calls[name]["all"] / done, 2)
            ratio = statistics.median(pairs)
            result[kind] = {
                **figures,
                "ratio": round(ratio, 3),
                "pair_ratios": [round(p, 3) for p in pairs],
            }
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
    parser.add_argument("--rounds", type=int, default=6, help="Rounds per gateway (alternating).")
    parser.add_argument("--seconds", type=float, default=4.0, help="Seconds per round.")
    parser.add_argument("--concurrency", type=int, default=8, help="Calls in flight.")
    parser.add_argument("--docs", type=int, default=5000, help="SciFact documents ingested.")
    parser.add_argument("--keep", action="store_true", help="Keep the work directory (logs).")
    args = parser.parse_args(argv)

    import redis

    from services.index.core.train import TrainOptions, train_index
    from tests.support.processes import free_port, redis_binary, run_redis
    from tests.support.shards import start_shard

    if not (DATA / "corpus.jsonl").exists():
        raise SystemExit(f"SciFact data not found at {DATA} (set GTR_DATA_DIR)")
    if redis_binary() is None:
        raise SystemExit("redis-server is not installed (scripts/bootstrap.sh)")
    work = Path(tempfile.mkdtemp(prefix="bench-generation-cost-"))
    baseline = _baseline_tree(args.baseline_rev, work / "before-src")
    lines = (DATA / "corpus.jsonl").read_text(encoding="utf-8").splitlines()[: args.docs]
    docs = [json.loads(line) for line in lines]
    vectors = np.load(DATA / "corpus.all-MiniLM-L6-v2.npy")[: len(docs)].astype(np.float32)
    queries = [
        json.loads(line)["text"]
        for line in (DATA / "queries.jsonl").read_text(encoding="utf-8").splitlines()[:300]
    ]
    print(f"training the index on {len(docs)} SciFact embeddings ...", flush=True)
    train_index(vectors, work / "index", TrainOptions(model="all-MiniLM-L6-v2", nprobe=16))
    try:
        with run_redis(work / "redis") as store:
            _ingest(store.url, vectors, docs)
            shard_proc = start_shard(
                index_dir=work / "index", redis_url=store.url, shard=0, shards=1,
                work_dir=work, settings={"search-threads": "0"}, timeout=600,
            )  # fmt: skip
            client = redis.Redis.from_url(store.url)
            try:
                targets = {"before": f"127.0.0.1:{free_port()}", "now": f"127.0.0.1:{free_port()}"}

                def gateway_argv(name: str) -> list[str]:
                    return [
                        sys.executable, "-m", "services.gateway.server", "--redis-url",
                        store.url, "--shards", shard_proc.address, "--encoder", "inprocess",
                        "--log-level", "WARNING", "--no-auth",
                        "--port", targets[name].rsplit(":", 1)[1],
                    ]  # fmt: skip

                with (
                    _process(gateway_argv("before"), work / "before.log", baseline) as before_proc,
                    _process(gateway_argv("now"), work / "now.log") as now_proc,
                ):
                    _wait(_healthy(targets["before"]), before_proc, work / "before.log", "before")
                    _wait(_healthy(targets["now"]), now_proc, work / "now.log", "now")
                    result = asyncio.run(
                        _measure(targets, client, queries, [d["_id"] for d in docs], args)
                    )
            finally:
                client.close()
                shard_proc.stop()
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    bookkeeping = _bookkeeping_us()
    share = bookkeeping["session"] / (result["search"]["now"]["p50_ms"] * 1000.0)
    print(
        f"generation bookkeeping per search: {bookkeeping} us = {share:.5%} of the search p50",
        flush=True,
    )
    print(
        json.dumps(
            {
                "bench": "generation_cost",
                "bookkeeping_us": bookkeeping,
                "bookkeeping_share_of_search_p50": round(share, 7),
                "search_ratio": result["search"]["ratio"],
                "get_ratio": result["get"]["ratio"],
                "search_alias_reads_per_call": result["search"]["now"]["alias_reads_per_call"],
                "baseline_rev": args.baseline_rev,
                "concurrency": args.concurrency,
                "rounds": args.rounds,
                "seconds": args.seconds,
                "docs": len(docs),
                **result,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
