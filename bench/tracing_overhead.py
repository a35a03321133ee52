"""What tracing costs: CPU per search of the gateway and the shards without tracing in
the code, with the code's tracing off, and with it on at 100 % sampling, in one run.

    flock -x /tmp/gtr-bench.lock .venv/bin/python -m bench.tracing_overhead [--searches 300]

Real processes: a Redis, one Triton (the wheel's, untraced: its CPU is not counted here),
and three identical sets of a gateway and 2 shard processes (inline search) on the same
store, fed the 5,183 SciFact documents (their all-MiniLM-L6-v2 vectors, written through
the change log, no encode):

- ``base``: the code of commit ``--base`` (default 1d341f3, the last one before tracing
  came in with 8690994), unpacked from git into a temporary folder and run from there:
  the same gateway and shards without a single tracing hook. Tracing off cannot be
  measured against "the hooks not called" within one build (an ``if`` around every hook
  is itself a hook), so the build without them is the baseline. It is not only the hooks
  that differ: what the commits since changed on a search's path (docs/tracing.md "Cost"
  lists it) counts in ``off_over_base`` too;
- ``off``: the code as it is, tracing off (the hooks present, no endpoint);
- ``on``: the code as it is with ``--otlp-endpoint`` to an OTLP/gRPC receiver in this
  process (tests/support/otlp.py; a collector's CPU is not the service's) at ratio 1:
  every search is traced and exported.

All three stay up; each round runs every set once, in an order that rotates, so the
machine's drift falls on all alike. A round sends ``--searches`` hybrid searches (the
SciFact train queries, top 10, dense and BM25 fused; the query encoded by Triton) from
``--clients`` concurrent clients, each with a client ``traceparent`` (sampled) as a
traced caller would. CPU = user + system time of the set's gateway and shard processes,
read from /proc/<pid>/stat before and after the round, per search. Figures: each set's
median over the rounds (``*_cpu_ms``), their ratios (``off_over_base``, ``on_over_off``,
``on_over_base``: the figures docs/tracing.md gives) and the same ratio within each round
(``*_rounds``: the spread);
``*_gateway_ms``: the gateway's part of a set's CPU (the rest is its shards');
``spans_per_search``: the spans the ``on`` set exported for the measured searches (fewer
than a lone search's 13 when concurrent searches share a wave). ``off_hook_ns`` is the
cost of one disabled hook timed here, for scale.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import timeit
from collections.abc import Iterator
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
from tests.support.processes import free_port, pythonpath, run_redis, wait_until
from tests.support.shards import shard_argv

RESULT = Path(__file__).resolve().parent / "results" / "tracing_overhead.json"
ROOT = Path(__file__).resolve().parents[1]
SHARDS = 2
BASE = "1d341f3"  # the last commit before tracing (8690994 brought it)
SETS = ("base", "off", "on")


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


def launch(name: str, argv: list[str], port: int, log: Path, root: Path) -> Service:
    """``argv`` (a server of ours listening on ``port``) run from the checkout ``root``,
    until its gRPC health says SERVING."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update({"PYTHONPATH": pythonpath(root), "OMP_NUM_THREADS": "1"})
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT)
    service = Service(name, port, proc)

    def serving() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited:\n{log.read_text(errors='replace')[-3000:]}")
        try:
            with grpc.insecure_channel(service.address) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=1.0
                )
            return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
        except grpc.RpcError:
            return False

    try:
        wait_until(serving, f"{name} serving", timeout=120, interval=0.1)
    except BaseException:
        service.stop()
        raise
    return service


@contextlib.contextmanager
def stack_set(
    name: str,
    root: Path,
    tmp: Path,
    redis_url: str,
    triton_url: str,
    tracing_flags: dict[str, str],
) -> Iterator[list[Service]]:
    """One set: ``SHARDS`` shard processes (inline search) and a gateway over them, the
    code of checkout ``root``; the gateway first. Stopped on exit."""
    services: list[Service] = []
    flags = [arg for key, value in tracing_flags.items() for arg in (f"--{key}", value)]
    try:
        for shard in range(SHARDS):
            port = free_port()
            argv = shard_argv(
                index_dir=tmp / "index",
                redis_url=redis_url,
                shard=shard,
                shards=SHARDS,
                replica=f"{name}-{shard}",
                port=port,
                snapshot_dir=tmp / name / f"shard-{shard}",
                settings={"search-threads": "0", **tracing_flags},
            )
            log = tmp / f"{name}-shard-{shard}.log"
            services.append(launch(f"{name} shard {shard}", argv, port, log, root))
        port = free_port()
        gateway = [sys.executable, "-m", "services.gateway.server", "--port", str(port)]
        gateway += ["--redis-url", redis_url, "--shards", ";".join(s.address for s in services)]
        gateway += ["--encoder", "triton", "--triton-url", triton_url, "--no-auth", *flags]
        services.insert(0, launch(f"{name} gateway", gateway, port, tmp / f"{name}.log", root))
        yield services
    finally:
        for service in services:
            service.stop()


def unpack(rev: str, into: Path) -> Path:
    """The tree of commit ``rev`` of this checkout, unpacked into ``into`` (its code, run
    from there, is the ``base`` set)."""
    into.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", rev],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


async def round_of(
    address: str, queries: list[str], offset: int, n: int, clients: int
) -> list[str]:
    """``n`` searches from ``clients`` concurrent clients; the trace ids they sent."""
    sent: list[str] = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = search_pb2_grpc.SearchServiceStub(channel)
        next_i = offset

        async def client() -> None:
            nonlocal next_i
            while next_i < offset + n:
                i = next_i
                next_i += 1
                trace_id = secrets.token_hex(16)
                sent.append(trace_id)
                reply = await stub.Search(
                    search_pb2.SearchRequest(query=queries[i % len(queries)], k=10),
                    timeout=10,
                    metadata=(("traceparent", f"00-{trace_id}-{secrets.token_hex(8)}-01"),),
                )
                assert reply.hits

        await asyncio.gather(*[client() for _ in range(clients)])
    return sent


def measure(
    pids: list[int], address: str, queries: list[str], offset: int, args: Any
) -> tuple[list[float], list[str]]:
    """CPU ms per search of each of ``pids`` over one round, and the round's trace ids."""
    before = [cpu_seconds(p) for p in pids]
    sent = asyncio.run(round_of(address, queries, offset, args.searches, args.clients))
    after = [cpu_seconds(p) for p in pids]
    return [(a - b) * 1000.0 / args.searches for a, b in zip(after, before, strict=True)], sent


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

    base_root = unpack(args.base, tmp / "base")
    traced = {"otlp-endpoint": receiver.grpc_endpoint, "trace-sample-ratio": "1"}
    with (
        run_triton(triton_cfg, tmp / "triton.log") as triton,
        stack_set("base", base_root, tmp, redis_url, triton.grpc_url, {}) as base,
        stack_set("off", ROOT, tmp, redis_url, triton.grpc_url, {}) as off,
        stack_set("on", ROOT, tmp, redis_url, triton.grpc_url, traced) as on,
    ):
        sets = {"base": base, "off": off, "on": on}
        pids = {name: [s.process.pid for s in services] for name, services in sets.items()}
        address = {name: services[0].address for name, services in sets.items()}
        # warm-up: every document applied (STRONG), channels open, caches warm
        for name in SETS:
            with grpc.insecure_channel(address[name]) as channel:
                search_pb2_grpc.SearchServiceStub(channel).Search(
                    search_pb2.SearchRequest(
                        query=queries[0], k=10, consistency=common_pb2.CONSISTENCY_STRONG
                    ),
                    timeout=60,
                )
            asyncio.run(round_of(address[name], queries, 0, 100, args.clients))
        per_round: dict[str, list[float]] = {name: [] for name in SETS}
        gateway_share: dict[str, list[float]] = {name: [] for name in SETS}
        traced_ids: set[str] = set()
        for r in range(args.rounds):
            for name in SETS[r % 3 :] + SETS[: r % 3]:
                offset = 100 + r * args.searches
                each, sent = measure(pids[name], address[name], queries, offset, args)
                ms = sum(each)
                per_round[name].append(ms)
                gateway_share[name].append(each[0])
                if name == "on":
                    traced_ids.update(sent)
                say(f"round {r + 1} {name}: {ms:.3f} ms CPU per search")
    # every process has stopped (and flushed what it had): count the measured ones' spans
    measured_spans = len(receiver.matching(lambda s: s.trace_id in traced_ids))
    median = {name: statistics.median(ms) for name, ms in per_round.items()}

    def ratios(top: str, bottom: str) -> list[float]:
        pairs = zip(per_round[top], per_round[bottom], strict=True)
        return [round(a / b, 3) for a, b in pairs]

    return {
        "searches_per_round": args.searches,
        "rounds": args.rounds,
        "clients": args.clients,
        "base": args.base,
        **{f"{name}_cpu_ms": round(ms, 3) for name, ms in median.items()},
        "off_over_base": round(median["off"] / median["base"], 3),
        "on_over_off": round(median["on"] / median["off"], 3),
        "on_over_base": round(median["on"] / median["base"], 3),
        **{f"{name}_rounds_ms": [round(x, 3) for x in ms] for name, ms in per_round.items()},
        "off_over_base_rounds": ratios("off", "base"),
        "on_over_off_rounds": ratios("on", "off"),
        # where it lands: the gateway's part (the rest is the shards')
        **{
            f"{name}_gateway_ms": round(statistics.median(ms), 3)
            for name, ms in gateway_share.items()
        },
        "spans_per_search": round(measured_spans / (args.rounds * args.searches), 2),
        "off_hook_ns": round(off_hook_ns(), 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--searches", type=int, default=300, help="Searches per round.")
    parser.add_argument("--rounds", type=int, default=6, help="Rounds (each runs every set).")
    parser.add_argument("--clients", type=int, default=4, help="Concurrent clients.")
    parser.add_argument(
        "--base", default=BASE, help=f"The commit without tracing (default {BASE})."
    )
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
