"""The hop-free server: what the default search reaches within its SLO with no inner hop
at all, beside what queueing alone allows and what the stack reaches, in one run (issue
#34 point 3; docs/performance.md "The hop-free server").

Three figures of the same hybrid searches, each the highest Poisson rate with p99 ≤ the
SLO (50 ms for the default model) and ≥ 99 % within it:

- ``model``: an M/G/c queue (:mod:`bench.queue_model`; c = the CPUs) whose service
  times are the floor's (:mod:`bench.floor`: one thread, no RPC) measured here: what any
  design doing this work per search could reach, were queueing the only cost;
- ``hop_free``: the floor served over gRPC by one process per CPU on one port (the
  kernel spreads connections, ``SO_REUSEPORT``), each answering inline on its event
  loop: the stack folded into the gateway, with no inner hop, no Redis, no batching,
  no thread hand-off. This is the upper bound of moving the shards into the gateway;
- ``stack`` (``--stack``): the local stack (``up``, 2 shards, the gateway's query
  graph) on the same documents.

The sweeps are loadtest's (:mod:`loadtest.sweep`; Poisson, ``--step-seconds`` per rate,
climbing by ``--factor`` then bisecting the edge twice). The ratios ``hop_free_over_model``
and ``stack_over_hop_free`` say where the rate is lost: in the runtime and the machine's
scheduling (the first), or in the stack's design (the second).

Usage: ``python -m bench.hop_free [--docs 1500] [--workers N] [--stack]
[--step-seconds 15] [--out bench/results/hop_free.json]``; ``serve`` is the worker
(started by the bench).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench import floor as floor_bench
from bench import queue_model

START_RATE = 30.0
CHANNELS = 8  # connections of the load: the kernel gives each to one worker
MODES = {1: "dense", 3: "hybrid"}  # search.proto's RetrievalMode values (0: the default)


def serve(corpus: Path, workdir: Path, port: int, ready: Path, precision: str) -> None:
    """One worker: build the floor, then answer Search on ``port`` until killed."""
    import grpc
    import uvloop

    from retrieval.v1 import search_pb2, search_pb2_grpc

    floor = floor_bench.build_floor(corpus, workdir, 2, precision)

    class Servicer(search_pb2_grpc.SearchServiceServicer):
        async def Search(self, request: Any, context: Any) -> Any:
            cpu = dict.fromkeys(floor_bench.STAGES, 0.0)
            mode = MODES.get(request.mode, "hybrid")
            docs = floor.search(request.query, mode, request.k or 10, cpu)
            hits = [search_pb2.Hit(id=d.id, title=d.title) for d in docs if d is not None]
            return search_pb2.SearchResponse(hits=hits)

    async def run() -> None:
        server = grpc.aio.server(options=[("grpc.so_reuseport", 1)])
        search_pb2_grpc.add_SearchServiceServicer_to_server(Servicer(), server)  # type: ignore[abstract]
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ready.write_text(str(os.getpid()))
        await server.wait_for_termination()

    uvloop.run(run())


@contextmanager
def hop_free_servers(
    corpus: Path, workdir: Path, workers: int, precision: str, timeout_s: float = 600.0
) -> Iterator[str]:
    """``workers`` serving processes on one free port; yields its address. Each runs in a
    session of its own and is stopped on the way out, a SIGTERM to the bench included
    (:func:`~services.stack.children.sigterm_as_interrupt`, as ``local_stack`` does)."""
    from services.stack.children import sigterm_as_interrupt
    from tests.support.processes import free_port, stop_process, wait_until

    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    with sigterm_as_interrupt():
        try:
            for n in range(workers):  # one at a time: each embeds the corpus on every CPU
                ready = workdir / f"ready-{n}"
                command = [sys.executable, "-m", "bench.hop_free", "serve"]
                command += ["--corpus", str(corpus), "--workdir", str(workdir / f"worker-{n}")]
                command += ["--port", str(port), "--ready", str(ready)]
                command += ["--query-precision", precision]
                procs.append(subprocess.Popen(command, start_new_session=True))
                wait_until(
                    lambda r=ready, p=procs[-1]: r.exists() or p.poll() is not None,  # type: ignore[misc]
                    f"hop-free worker {n}",
                    timeout=timeout_s,
                )
                if procs[-1].poll() is not None:
                    raise RuntimeError(f"hop-free worker {n} exited {procs[-1].returncode}")
            yield f"127.0.0.1:{port}"
        finally:
            for proc in procs:
                stop_process(proc, timeout=30)


def warm(address: str, seconds: float = 15.0) -> None:
    """Open-loop searches at the first rate over the sweep's connections, not recorded:
    a worker's first searches are slow (ONNX Runtime's first runs, each connection's
    first call), and a sweep whose first step breaks only steps down."""
    from loadtest.processes import run_in_processes
    from loadtest.runner import RunConfig
    from loadtest.target import Target
    from loadtest.workload import Workload, load_queries

    workload = Workload(queries=load_queries(None), mode="hybrid")
    run = RunConfig(rate=START_RATE, duration_s=seconds, seed=5, channels=CHANNELS)
    asyncio.run(run_in_processes(Target(address=address), workload, run, 1))


def sweep_rate(address: str, args: argparse.Namespace, title: str, png: Path) -> dict[str, Any]:
    """loadtest's open-loop sweep of hybrid searches against ``address``."""
    from loadtest.budget import default_slo_ms
    from loadtest.stack_report import run_sweep
    from loadtest.sweep import SweepConfig
    from loadtest.target import Target
    from loadtest.workload import Workload, load_queries

    slo = default_slo_ms("minilm")
    cfg = SweepConfig(
        start_rate=START_RATE,
        slo_ms=slo,
        factor=args.factor,
        min_rate=START_RATE / args.factor**4,
        step_s=args.step_seconds,
        refine=2,
    )
    workload = Workload(queries=load_queries(None), mode="hybrid")
    return asyncio.run(
        run_sweep(Target(address=address), workload, cfg, png, title, False, CHANNELS)
    )


def model_of(floor_wall_ms: list[float], servers: int, slo_ms: float) -> dict[str, Any]:
    model = queue_model.best_rate(floor_wall_ms, servers, slo_ms)
    return {
        "servers": servers,
        "best_rate": round(model.best_rate, 1),
        "p99_ms": round(model.p99_ms, 2),
        "ceiling": round(model.ceiling, 1),
        "over_ceiling": round(model.over_ceiling, 3),
    }


def floor_walls(floor: floor_bench.Floor, queries: list[str]) -> list[float]:
    """The floor's wall time per hybrid search (ms), one thread, after a warm-up pass."""
    cpu = dict.fromkeys(floor_bench.STAGES, 0.0)
    walls: list[float] = []
    for n, q in enumerate(queries[:20] + queries):
        start = time.perf_counter()
        floor.search(q, "hybrid", 10, cpu)
        if n >= 20:
            walls.append(1e3 * (time.perf_counter() - start))
    return walls


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.hop_free",
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--docs", type=int, default=1500, help="SciFact documents (1500)")
    p.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)), help="(CPUs)")
    p.add_argument("--stack", action="store_true", help="sweep the local stack too")
    p.add_argument("--step-seconds", type=float, default=15.0, help="per sweep rate (15)")
    p.add_argument("--factor", type=float, default=1.4, help="rate multiplier per step (1.4)")
    p.add_argument("--query-precision", choices=["fp32", "int8"], default="int8")
    p.add_argument("--out", type=Path, default=Path("bench/results/hop_free.json"))
    sub = p.add_subparsers(dest="command")
    w = sub.add_parser("serve", help="one worker (started by the bench)")
    w.add_argument("--corpus", type=Path, required=True)
    w.add_argument("--workdir", type=Path, required=True)
    w.add_argument("--port", type=int, required=True)
    w.add_argument("--ready", type=Path, required=True)
    w.add_argument("--query-precision", choices=["fp32", "int8"], default="int8")
    return p


def measure(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from loadtest.budget import default_slo_ms
    from tests.support.local_stack import local_stack, queries, small_corpus

    corpus = tmp / "corpus.jsonl"
    small_corpus(floor_bench.SCIFACT, corpus, args.docs, text_chars=100_000)
    texts = queries(floor_bench.SCIFACT, 300)
    slo = default_slo_ms("minilm")
    floor = floor_bench.build_floor(corpus, tmp / "floor", 2, args.query_precision)
    walls = floor_walls(floor, texts)
    del floor
    out: dict[str, Any] = {
        "docs": args.docs,
        "slo_ms": slo,
        "query_precision": args.query_precision,
        "floor_wall_ms": {"p50": _pct(walls, 50), "p99": _pct(walls, 99)},
        "model": model_of(walls, args.workers, slo),
    }
    print(f"model (M/G/{args.workers}, the floor's service times): {out['model']}", flush=True)
    with hop_free_servers(corpus, tmp / "hop-free", args.workers, args.query_precision) as at:
        warm(at)
        out["hop_free"] = sweep_rate(at, args, "hop-free server", tmp / "hop-free.png")
    out["hop_free"]["workers"] = args.workers
    if args.stack:
        extra = ["--query-precision", args.query_precision]
        with local_stack(tmp / "run", tmp / "up.log", corpus=corpus, shards=2, extra=extra) as st:
            warm(st.gateway)
            out["stack"] = sweep_rate(st.gateway, args, "local stack", tmp / "stack.png")
    return out


def add_ratios(out: dict[str, Any]) -> None:
    model, hop_free = out["model"]["best_rate"], out["hop_free"]["best_rate"]
    out["hop_free_over_model"] = round(hop_free / model, 3) if hop_free and model else None
    stack = out.get("stack", {}).get("best_rate")
    out["stack_over_hop_free"] = round(stack / hop_free, 3) if stack and hop_free else None


def _pct(values: list[float], q: float) -> float:
    import numpy as np

    return round(float(np.percentile(values, q)), 2)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.command == "serve":
        serve(args.corpus, args.workdir, args.port, args.ready, args.query_precision)
        return {}
    load_before = [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="gtr-bench-hop-free-") as tmp_name:
        out = measure(args, Path(tmp_name))
    add_ratios(out)
    out["loadavg_before"] = load_before
    out["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    out["measured_at"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    for key in ("model", "hop_free", "stack"):
        if key in out:
            print(f"{key}: best rate within {out['slo_ms']:g} ms: {out[key]['best_rate']}/s")
    print(
        f"hop_free_over_model {out['hop_free_over_model']}  "
        f"stack_over_hop_free {out['stack_over_hop_free']}"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
