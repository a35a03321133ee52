"""What a quiet search pays besides its work: a cold core and a hop (issue #34).

    .venv/bin/python -m bench.hop_costs [--queries 150] [--gaps-ms 0,2,10,50] [--trips 3000]

The stage timings of a hybrid search at 20/s on the local stack (docs/performance.md,
"Where a quiet search's time goes") are 2-6 times the CPU each stage costs in
``bench.floor``'s tight loop. Two measurements, each against its own baseline in the
same run, say how much of that is the machine rather than our code:

- **A cold core** (``graph``): the int8 query graph ``up`` serves (ONNX Runtime, one
  thread, the same export) run on SciFact queries back to back, and again with a pause of
  ``--gaps-ms`` between runs, as a search stage at 20/s runs. ``cold_over_warm`` per gap
  is the median run time ÷ the back-to-back median (in the same process and order, the
  gaps alternated by round).
- **A hop** (``hop``): one round trip between two processes on this machine, a request of
  1.5 KB and an answer of 3.2 KB (a hybrid search's shard request and answer), sequential,
  over a grpc.aio bidi stream (the router's ``SearchStream``) and over a bare asyncio Unix
  socket with a 4-byte length prefix (no framing, no thread): wall time and the CPU of
  both sides per round trip (``/proc``). ``grpc_over_socket`` compares the two. Each on
  the standard library's event loop and on uvloop's (both sides), ``uvloop_over_asyncio``.

Nothing else of the stack runs. One JSON line last (``--out``, default
``bench/results/hop_costs.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import struct
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from services.rpc.event_loop import LOOPS, EventLoop, loop_factory

REQUEST = b"q" * 1500
ANSWER = b"a" * 3200
METHOD = "/bench.Hop/Trip"


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# --- a cold core -----------------------------------------------------------------------


def measure_graph(queries: list[str], gaps_ms: list[float], rounds: int) -> dict[str, Any]:
    """Median run time of the int8 query graph per gap (0: back to back)."""
    from services.encoder.build.query_int8 import export_with_int8_query
    from services.encoder.model import default_model_dir
    from services.encoder.runtime.onnx_embedder import OnnxEmbedder

    with tempfile.TemporaryDirectory(prefix="gtr-hop-") as tmp:
        onnx_path = Path(tmp) / "model.onnx"
        export_with_int8_query(default_model_dir(), onnx_path, None)
        embedder = OnnxEmbedder(onnx_path, threads=1)
        for q in queries[:20]:  # warm-up, not measured
            embedder.embed([q], "query")
        runs: dict[float, list[float]] = {g: [] for g in gaps_ms}
        for r in range(rounds):
            order = gaps_ms if r % 2 == 0 else list(reversed(gaps_ms))
            for gap in order:
                for q in queries:
                    start = time.perf_counter()
                    embedder.embed([q], "query")
                    runs[gap].append((time.perf_counter() - start) * 1e3)
                    if gap:
                        time.sleep(gap / 1e3)
    warm = statistics.median(runs[0.0]) if 0.0 in runs else float("nan")
    per_gap = {
        f"{g:g}": {
            "median_ms": round(statistics.median(v), 3),
            "p90_ms": round(float(np.percentile(v, 90)), 3),
            "cold_over_warm": round(statistics.median(v) / warm, 2),
        }
        for g, v in runs.items()
    }
    return {"queries": len(queries), "rounds": rounds, "per_gap_ms": per_gap}


# --- a hop -----------------------------------------------------------------------------


async def _grpc_server(port: int, ready: Any, stop: Any) -> None:
    async def trip(requests: Any, context: Any) -> Any:
        async for _ in requests:
            yield ANSWER

    handler = grpc.method_handlers_generic_handler(
        "bench.Hop", {"Trip": grpc.stream_stream_rpc_method_handler(trip)}
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    ready.set()
    while not stop.is_set():
        await asyncio.sleep(0.05)
    await server.stop(0)


async def _socket_server(path: str, ready: Any, stop: Any) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                (size,) = struct.unpack("<I", await reader.readexactly(4))
                await reader.readexactly(size)
                writer.write(struct.pack("<I", len(ANSWER)) + ANSWER)
        except asyncio.IncompleteReadError:
            writer.close()

    server = await asyncio.start_unix_server(serve, path)
    ready.set()
    while not stop.is_set():
        await asyncio.sleep(0.05)
    server.close()


def _runner(loop: EventLoop) -> asyncio.Runner:
    return asyncio.Runner(loop_factory=loop_factory(loop))


def _serve(kind: str, loop: EventLoop, where: Any, ready: Any, stop: Any) -> None:
    serve = _grpc_server if kind == "grpc" else _socket_server
    with _runner(loop) as runner:
        runner.run(serve(where, ready, stop))


async def _grpc_trips(port: int, trips: int, server_pid: int) -> tuple[float, float, float]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream(METHOD)()
        for _ in range(50):  # warm-up
            await call.write(REQUEST)
            await call.read()
        cpu0, server0, start = time.process_time(), _cpu_s(server_pid), time.perf_counter()
        for _ in range(trips):
            await call.write(REQUEST)
            await call.read()
        wall = time.perf_counter() - start
        cpu, server = time.process_time() - cpu0, _cpu_s(server_pid) - server0
        await call.done_writing()
    return wall, cpu, server


async def _socket_trips(path: str, trips: int, server_pid: int) -> tuple[float, float, float]:
    reader, writer = await asyncio.open_unix_connection(path)
    frame = struct.pack("<I", len(REQUEST)) + REQUEST

    async def trip() -> None:
        writer.write(frame)
        (size,) = struct.unpack("<I", await reader.readexactly(4))
        await reader.readexactly(size)

    for _ in range(50):
        await trip()
    cpu0, server0, start = time.process_time(), _cpu_s(server_pid), time.perf_counter()
    for _ in range(trips):
        await trip()
    wall = time.perf_counter() - start
    cpu, server = time.process_time() - cpu0, _cpu_s(server_pid) - server0
    writer.close()
    return wall, cpu, server


def measure_hop(kind: str, loop: EventLoop, trips: int, tmp: Path) -> dict[str, float]:
    """One server process, this process the client, both on ``loop``; µs per round
    trip."""
    from tests.support.processes import free_port

    ctx = multiprocessing.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    where: Any = free_port() if kind == "grpc" else str(tmp / "hop.sock")
    server = ctx.Process(target=_serve, args=(kind, loop, where, ready, stop), daemon=True)
    server.start()
    try:
        if not ready.wait(60):
            raise RuntimeError(f"the {kind} server did not start")
        trips_of = _grpc_trips if kind == "grpc" else _socket_trips
        assert server.pid is not None
        with _runner(loop) as runner:
            wall, cpu, server_cpu = runner.run(trips_of(where, trips, server.pid))
    finally:
        stop.set()
        server.join(10)
        if server.is_alive():
            server.kill()
    return {
        "wall_us": round(wall / trips * 1e6, 1),
        "client_cpu_us": round(cpu / trips * 1e6, 1),
        "server_cpu_us": round(server_cpu / trips * 1e6, 1),
    }


def _mean(old: dict[str, float], new: dict[str, float], n: int) -> dict[str, float]:
    """The running mean of ``n`` rounds' rows and ``new``."""
    return {k: round((old[k] * n + new[k]) / (n + 1), 1) for k in old}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.hop_costs", description=__doc__)
    parser.add_argument("--queries", type=int, default=150, help="SciFact queries per gap")
    parser.add_argument("--gaps-ms", default="0,2,10,50", help="pauses between graph runs")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over the gaps")
    parser.add_argument("--trips", type=int, default=3000, help="round trips per transport")
    parser.add_argument("--out", type=Path, default=Path("bench/results/hop_costs.json"))
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from loadtest.workload import load_queries

    args = build_parser().parse_args(argv)
    gaps = sorted({0.0, *(float(g) for g in args.gaps_ms.split(","))})
    queries = load_queries(None)[: args.queries]
    loadavg_before = list(os.getloadavg())
    graph = measure_graph(queries, gaps, args.rounds)
    for gap, row in graph["per_gap_ms"].items():
        print(
            f"graph, {gap:>3} ms between runs: median {row['median_ms']:.2f} ms "
            f"(x{row['cold_over_warm']:.2f} of back to back)",
            flush=True,
        )
    hop: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="gtr-hop-") as tmp:
        for r in range(args.rounds):  # rounds alternate the order
            variants = [(k, lp) for k in ("grpc", "socket") for lp in reversed(LOOPS)]
            for kind, loop in variants if r % 2 == 0 else list(reversed(variants)):
                row = measure_hop(kind, loop, args.trips, Path(tmp))
                name = f"{kind}/{loop}"
                hop[name] = row if name not in hop else _mean(hop[name], row, r)
    for name, row in hop.items():
        print(
            f"hop, {name}: {row['wall_us']:.0f} us a round trip, CPU "
            f"{row['client_cpu_us']:.0f} us client + {row['server_cpu_us']:.0f} us server",
            flush=True,
        )
    cpu = {k: v["client_cpu_us"] + v["server_cpu_us"] for k, v in hop.items()}
    wall = {k: v["wall_us"] for k, v in hop.items()}
    result = {
        "source": {"bench": "hop_costs", "run": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
        "graph": graph,
        "hop": hop,
        "grpc_over_socket": {
            loop: {
                "wall": round(wall[f"grpc/{loop}"] / wall[f"socket/{loop}"], 2),
                "cpu": round(cpu[f"grpc/{loop}"] / cpu[f"socket/{loop}"], 2),
            }
            for loop in ("asyncio", "uvloop")
        },
        "uvloop_over_asyncio": {
            kind: {
                "wall": round(wall[f"{kind}/uvloop"] / wall[f"{kind}/asyncio"], 2),
                "cpu": round(cpu[f"{kind}/uvloop"] / cpu[f"{kind}/asyncio"], 2),
            }
            for kind in ("grpc", "socket")
        },
        "loadavg_before": loadavg_before,
        "loadavg_after": list(os.getloadavg()),
    }
    line = json.dumps(result)
    print(line)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(line + "\n")
    return result


if __name__ == "__main__":
    main()
