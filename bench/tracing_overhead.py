"""What tracing costs: CPU per search of the gateway and the shards, tracing off against
tracing on at 100 % sampling, in one run.

    flock -x /tmp/gtr-bench.lock .venv/bin/python -m bench.tracing_overhead [--searches 300]

Real processes: a Redis, one Triton (the wheel's, untraced: its CPU is not counted here),
and two identical sets of a gateway and 2 shard processes (inline search) on the same
store, fed the 5,183 SciFact documents (their all-MiniLM-L6-v2 vectors, written through
the change log, no encode). Set ``off`` runs the code as shipped with tracing off (the
hooks present, no endpoint); set ``on`` runs with ``--otlp-endpoint`` to an OTLP/gRPC
receiver in this process (tests/support/otlp.py; a collector's CPU is not the service's)
at ratio 1: every search is traced and exported. Both sets stay up; the rounds alternate
them (``--rounds`` each), so the machine's drift falls on both alike.

A round sends ``--searches`` hybrid searches (the SciFact train queries, top 10, dense and
BM25 fused; the query encoded by Triton) from ``--clients`` concurrent clients, each with
a client ``traceparent`` (sampled) as a traced caller would. CPU = user + system time of
the set's gateway and shard processes, read from /proc/<pid>/stat before and after the
round, per search. Figures: ``off_cpu_ms`` and ``on_cpu_ms`` per search (the medians of
the rounds) and ``on_over_off``. Tracing off has no separate baseline: without an
endpoint no tracer exists, and each hook is a global read and a call that returns a
shared no-op (``off_hook_ns``: the cost of one such call, timed here, times the hooks
one search passes, ``off_hooks_per_search``: its share of ``off_cpu_ms`` is
``off_over_untraced``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import timeit
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.index_service import CACHE, SCIFACT, say
from retrieval.v1 import common_pb2, search_pb2, search_pb2_grpc
from services.corpus.beir import load_beir
from services.index.client.writer import ChangeLogWriter, DocRecord
from services.index.core.train import TrainOptions, train_index
from services.telemetry import tracing
from tests.support.otlp import Receiver, otlp_receiver
from tests.support.processes import free_port, run_redis, wait_until
from tests.support.shards import run_shards

RESULT = Path(__file__).resolve().parent / "results" / "tracing_overhead.json"
ROOT = Path(__file__).resolve().parents[1]
SHARDS = 2
# The hooks one hybrid search passes in the gateway and a shard with tracing off (server
# span, encode, Triton infer, index search, wave, 2 shard searches, fusion, fetch, exemplar
# reads; per shard: stream span, dense, BM25): counted from the code, an upper bound.
HOOKS_PER_SEARCH = 24


@dataclass
class Service:
    name: str
    port: int
    process: subprocess.Popen[bytes]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def cpu_seconds(pid: int) -> float:
    """User + system CPU of process ``pid`` (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_gateway(args: list[str], log: Path) -> Service:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update({"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.gateway.server", "--port", str(port), *args],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    service = Service("gateway", port, proc)

    def serving() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited:\n{log.read_text(errors='replace')[-3000:]}")
        try:
            with grpc.insecure_channel(service.address) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=1.0
                )
            return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
        except grpc.RpcError:
            return False

    wait_until(serving, "gateway serving", timeout=120, interval=0.1)
    return service


async def round_of(address: str, queries: list[str], offset: int, n: int, clients: int) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = search_pb2_grpc.SearchServiceStub(channel)
        next_i = offset

        async def client() -> None:
            nonlocal next_i
            while next_i < offset + n:
                i = next_i
                next_i += 1
                parent = f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"
                reply = await stub.Search(
                    search_pb2.SearchRequest(query=queries[i % len(queries)], k=10),
                    timeout=10,
                    metadata=(("traceparent", parent),),
                )
                assert reply.hits

        await asyncio.gather(*[client() for _ in range(clients)])


def measure(pids: list[int], address: str, queries: list[str], offset: int, args: Any) -> float:
    """CPU ms per search of ``pids`` over one round."""
    before = sum(cpu_seconds(p) for p in pids)
    asyncio.run(round_of(address, queries, offset, args.searches, args.clients))
    return (sum(cpu_seconds(p) for p in pids) - before) * 1000.0 / args.searches


def off_hook_ns() -> float:
    """One disabled hook (``with tracing.span(...)``), in ns."""
    assert not tracing.enabled()

    def hook() -> None:
        with tracing.span("x"):
            pass

    return min(timeit.repeat(hook, number=100_000, repeat=5)) / 100_000 * 1e9


def ingest(url: str, records: list[DocRecord]) -> None:
    async def run() -> None:
        writer = ChangeLogWriter.connect(url, SHARDS, dim=records[0].vector.shape[0])
        try:
            for i in range(0, len(records), 256):
                await writer.upsert(records[i : i + 256])
        finally:
            await writer.close()

    asyncio.run(run())


def triton_repo(tmp: Path) -> Path:
    from services.encoder.build.export import export_onnx
    from services.encoder.build.repository import RepositoryConfig, generate_repository
    from services.encoder.model import default_model_dir

    onnx_path = CACHE / "onnx" / "all-MiniLM-L6-v2" / "model.onnx"
    if not onnx_path.exists():
        export_onnx(default_model_dir(), onnx_path)
    repo = tmp / "repo"
    generate_repository(onnx_path, repo, RepositoryConfig(instances=1, intra_op_threads=1))
    return repo


def run(args: Any, receiver: Receiver, tmp: Path) -> dict[str, Any]:
    from services.encoder.serve.triton_server import TritonServerConfig

    ids = load_beir(SCIFACT).doc_ids
    corpus = {}
    with (SCIFACT / "corpus.jsonl").open(encoding="utf-8") as fh:
        for line in fh:
            row = json.loads(line)
            corpus[row["_id"]] = (row.get("title", ""), row.get("text", ""))
    vectors = np.load(SCIFACT / "corpus.all-MiniLM-L6-v2.npy").astype(np.float32)
    records = [DocRecord(d, vectors[i], corpus[d][0], corpus[d][1]) for i, d in enumerate(ids)]
    with (SCIFACT / "queries.jsonl").open(encoding="utf-8") as fh:
        queries = [json.loads(line)["text"] for line in fh]
    say(f"training the index on {len(vectors)} vectors")
    train_index(vectors, tmp / "index", TrainOptions(model="all-MiniLM-L6-v2"))
    triton_cfg = TritonServerConfig(
        triton_repo(tmp),
        grpc_port=free_port(),
        http_port=free_port(),
        metrics_port=free_port(),
        http=False,
        startup_timeout_s=180,
    )
    with run_redis(tmp / "redis") as redis_server:
        say(f"logging {len(records)} documents through the change log")
        ingest(redis_server.url, records)
        return measured(args, receiver, tmp, redis_server.url, triton_cfg, queries)


def measured(
    args: Any,
    receiver: Receiver,
    tmp: Path,
    redis_url: str,
    triton_cfg: Any,
    queries: list[str],
) -> dict[str, Any]:
    from services.encoder.serve.triton_server import run_triton

    inline = {"search-threads": "0"}
    traced = {"otlp-endpoint": receiver.grpc_endpoint, "trace-sample-ratio": "1"}
    with (
        run_triton(triton_cfg, tmp / "triton.log") as triton,
        run_shards(
            tmp / "index", redis_url, tmp / "off", shards=SHARDS, settings=inline
        ) as off_shards,
        run_shards(
            tmp / "index",
            redis_url,
            tmp / "on",
            shards=SHARDS,
            settings={**inline, **traced},
        ) as on_shards,
    ):
        gateways: dict[str, Service] = {}
        try:
            for name, shards in (("off", off_shards), ("on", on_shards)):
                flags = [] if name == "off" else ["--otlp-endpoint", receiver.grpc_endpoint]
                gateways[name] = start_gateway(
                    [
                        "--redis-url",
                        redis_url,
                        "--shards",
                        ";".join(",".join(r) for r in shards.addresses),
                        "--encoder",
                        "triton",
                        "--triton-url",
                        triton.grpc_url,
                        "--no-auth",
                        *flags,
                    ],
                    tmp / f"gateway-{name}.log",
                )
            pids = {
                name: [gateways[name].process.pid]
                + [p.process.pid for p in shards.all() if p.process is not None]
                for name, shards in (("off", off_shards), ("on", on_shards))
            }
            # warm-up: every document applied (STRONG), channels open, caches warm
            for name in ("off", "on"):
                with grpc.insecure_channel(gateways[name].address) as channel:
                    search_pb2_grpc.SearchServiceStub(channel).Search(
                        search_pb2.SearchRequest(
                            query=queries[0], k=10, consistency=common_pb2.CONSISTENCY_STRONG
                        ),
                        timeout=60,
                    )
                asyncio.run(round_of(gateways[name].address, queries, 0, 100, args.clients))
            exported_before = len(receiver.spans)
            per_round: dict[str, list[float]] = {"off": [], "on": []}
            for r in range(args.rounds):
                for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
                    offset = 100 + r * args.searches
                    ms = measure(pids[name], gateways[name].address, queries, offset, args)
                    per_round[name].append(ms)
                    say(f"round {r + 1} {name}: {ms:.3f} ms CPU per search")
            receiver.wait(
                lambda rc: len(rc.spans) > exported_before, "the traced rounds' spans", 30
            )
        finally:
            for service in gateways.values():
                service.stop()
    off = statistics.median(per_round["off"])
    on = statistics.median(per_round["on"])
    hook_ns = off_hook_ns()
    return {
        "searches_per_round": args.searches,
        "rounds": args.rounds,
        "clients": args.clients,
        "off_cpu_ms": round(off, 3),
        "on_cpu_ms": round(on, 3),
        "on_over_off": round(on / off, 3),
        "off_rounds_ms": [round(x, 3) for x in per_round["off"]],
        "on_rounds_ms": [round(x, 3) for x in per_round["on"]],
        "off_hook_ns": round(hook_ns, 1),
        "off_hooks_per_search": HOOKS_PER_SEARCH,
        "off_over_untraced": round(1 + HOOKS_PER_SEARCH * hook_ns / 1e6 / off, 4),
        "spans_received": len(receiver.spans),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--searches", type=int, default=300, help="Searches per round.")
    parser.add_argument("--rounds", type=int, default=4, help="Rounds per set (alternated).")
    parser.add_argument("--clients", type=int, default=4, help="Concurrent clients.")
    parser.add_argument("--no-save", action="store_true", help=f"Do not write {RESULT}.")
    args = parser.parse_args()
    uptime = Path("/proc/loadavg").read_text().split()[:3]
    with tempfile.TemporaryDirectory() as tmp, otlp_receiver() as receiver:
        result = run(args, receiver, Path(tmp))
    result["loadavg_at_start"] = uptime
    result["loadavg_at_end"] = Path("/proc/loadavg").read_text().split()[:3]
    line = json.dumps(result)
    print(line)
    if not args.no_save:
        RESULT.parent.mkdir(parents=True, exist_ok=True)
        RESULT.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
