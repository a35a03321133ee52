"""What a rollout's work on the *other* CPU costs a search's work on this one (issue #33).

    .venv/bin/python -m bench.neighbor [--queries 200] [--rounds 3] [--gap-ms 10]

During a new-encoder rollout the search p99 rose 2-3x whatever the rollout's placement:
its own CPU (``--cpus``), nice, SCHED_IDLE and pacing all left it there
(docs/generations.md). A CPU budget only helps if work on one CPU leaves the other's
speed alone. This bench asks that of the machine, with no code of the stack in the way:

- the **search's work**: the int8 query graph ``up`` serves (ONNX Runtime, one thread),
  SciFact's queries one at a time with ``--gap-ms`` between them (a search stage at
  ~100/s), pinned to CPU 0; wall time per run;
- the **neighbour**: a process encoding SciFact documents with the FP32 document graph
  (the builder's and the dual write's work; ONNX Runtime, one thread) in a loop, or
  spinning in pure Python (no vector units), placed:

  - ``none``: no neighbour (the baseline);
  - ``other_cpu_encode`` / ``other_cpu_spin``: pinned to CPU 1, the budget's placement;
  - ``same_cpu_encode_idle``: on CPU 0 under SCHED_IDLE (runs only when CPU 0 has
    nothing else to run);
  - ``same_cpu_encode``: on CPU 0 at normal priority.

Scenarios alternate by round (their order reversed every other round). Per scenario:
median, p90 and p99 of the graph's wall time, each ÷ ``none``'s. A ratio near 1 for
``other_cpu_*`` means the CPUs are independent (a budget protects the searches); well
above 1, the neighbour slows this CPU's work through what the two vCPUs share (the
hypervisor's placement, the core's frequency, caches, memory), which no placement of
ours can undo. One JSON line last (``--out``, default ``bench/results/neighbor.json``).
Needs 2 CPUs; run it alone.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import tempfile
import time
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import numpy as np

SCENARIOS = (
    "none",
    "other_cpu_encode",
    "other_cpu_spin",
    "same_cpu_encode_idle",
    "same_cpu_encode",
)
SEARCH_CPU = 0
OTHER_CPU = 1


def _neighbour(
    kind: str, cpu: int, idle: bool, onnx_path: str, docs: list[str], ready: Any
) -> None:
    """Encode ``docs`` round and round (``kind`` "encode") or spin, on ``cpu``, until killed
    (or the bench dies: a bench killed by ``timeout`` must not leave it spinning)."""
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    os.sched_setaffinity(0, {cpu})
    if idle:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    if kind == "spin":
        ready.set()
        n = 0
        while True:
            n += 1
    from services.encoder.runtime.onnx_embedder import OnnxEmbedder

    embedder = OnnxEmbedder(Path(onnx_path), threads=1)
    embedder.embed(docs[:1], "document")
    ready.set()
    while True:
        for doc in docs:
            embedder.embed([doc], "document")


def _start(scenario: str, onnx_path: Path, docs: list[str]) -> BaseProcess | None:
    if scenario == "none":
        return None
    kind = "spin" if scenario.endswith("spin") else "encode"
    cpu = OTHER_CPU if scenario.startswith("other_cpu") else SEARCH_CPU
    idle = scenario.endswith("_idle")
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(
        target=_neighbour, args=(kind, cpu, idle, str(onnx_path), docs, ready), daemon=True
    )
    proc.start()
    if not ready.wait(120):
        proc.kill()
        raise RuntimeError(f"the {scenario} neighbour did not start")
    return proc


def _runs(embedder: Any, queries: list[str], gap_s: float) -> list[float]:
    out = []
    for q in queries:
        start = time.perf_counter()
        embedder.embed([q], "query")
        out.append((time.perf_counter() - start) * 1e3)
        time.sleep(gap_s)
    return out


def measure(
    onnx_path: Path, queries: list[str], docs: list[str], rounds: int, gap_ms: float
) -> dict[str, list[float]]:
    from services.encoder.runtime.onnx_embedder import OnnxEmbedder

    os.sched_setaffinity(0, {SEARCH_CPU})
    embedder = OnnxEmbedder(onnx_path, threads=1)
    _runs(embedder, queries[:20], 0.0)  # warm-up, not measured
    times: dict[str, list[float]] = {s: [] for s in SCENARIOS}
    for r in range(rounds):
        for scenario in SCENARIOS if r % 2 == 0 else tuple(reversed(SCENARIOS)):
            proc = _start(scenario, onnx_path, docs)
            try:
                times[scenario] += _runs(embedder, queries, gap_ms / 1e3)
            finally:
                if proc is not None:
                    proc.kill()
                    proc.join()
            print(
                f"round {r + 1} {scenario}: median {np.median(times[scenario]):.2f} ms", flush=True
            )
    return times


def summarise(times: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    def q(values: list[float], p: float) -> float:
        return float(np.percentile(values, p))

    base = times["none"]
    out = {}
    for scenario, values in times.items():
        row = {f"p{p}_ms": round(q(values, p), 3) for p in (50, 90, 99)}
        row |= {f"p{p}_over_none": round(q(values, p) / q(base, p), 2) for p in (50, 90, 99)}
        out[scenario] = row
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.neighbor", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--queries", type=int, default=200, help="SciFact queries per scenario and round"
    )
    parser.add_argument(
        "--docs", type=int, default=64, help="SciFact documents the neighbour encodes"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gap-ms", type=float, default=10.0, help="pause between two query runs")
    parser.add_argument("--out", type=Path, default=Path("bench/results/neighbor.json"))
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from loadtest.workload import load_documents, load_queries
    from services.encoder.build.query_int8 import export_with_int8_query
    from services.encoder.model import default_model_dir

    args = build_parser().parse_args(argv)
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("bench.neighbor needs 2 CPUs")
    queries = load_queries(None)[: args.queries]
    docs = [f"{title}. {text}" for title, text in load_documents(None, args.docs)]
    loadavg_before = list(os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="gtr-neighbor-") as tmp:
        onnx_path = Path(tmp) / "model.onnx"
        export_with_int8_query(default_model_dir(), onnx_path, None)
        times = measure(onnx_path, queries, docs, args.rounds, args.gap_ms)
    result = {
        "source": {"bench": "neighbor", "run": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
        "queries": len(queries),
        "rounds": args.rounds,
        "gap_ms": args.gap_ms,
        "loadavg_before": loadavg_before,
        "loadavg_after": list(os.getloadavg()),
        "scenarios": summarise(times),
    }
    for scenario, row in result["scenarios"].items():
        print(
            f"{scenario:>22}: p50 {row['p50_ms']:.2f} ms (x{row['p50_over_none']:.2f}), "
            f"p99 {row['p99_ms']:.2f} ms (x{row['p99_over_none']:.2f})",
            flush=True,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result) + "\n")
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
