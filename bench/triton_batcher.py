"""Triton's dynamic batcher with and without a queue policy or priority levels, on the
CPU repository.

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.triton_batcher [--rate 15] [--seconds 20]

Three repositories of the default model, each served by its own tritonserver in turn:
``default`` (``encoder repo``'s CPU layout: preferred sizes 16…64, a 1 ms delay, no
queue policy, one queue), ``queue-policy`` (the layout before: the same sizes, a 4 ms
delay and ``max_queue_size`` 1024) and ``priority-levels`` (the default with
``--priority-levels 2``, the layout of 2026-11-24 to 11-29). For each:

* a late arrival: a request sent 2–13 ms after another (so it comes in while the first
  runs) and nothing after it; its latency, worst and p99 over ``--trials``;
* open loop: Poisson arrivals at ``--rate`` for ``--seconds`` (seeded; latency from the
  scheduled time), p50/p99/max;
* closed loop: texts/s of 16 callers sending one query each.

With a queue policy, and with priority levels, Triton 24.10 leaves the late arrival in
its queue until the next request comes in, so its latency is the gap to the next arrival
(~0.5 s when there is none); the ratios printed last are each layout ÷ ``default``. One
JSON line last.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.closedloop import closed_loop
from loadtest.results import json_line
from loadtest.workload import load_queries

LAYOUTS: dict[str, dict[str, Any]] = {
    "default": {},
    "queue-policy": {
        "max_queue_size": 1024,
        "preferred_batch_sizes": (16, 32, 64),
        "max_queue_delay_us": 4000,
    },
    "priority-levels": {"priority_levels": 2},
}


async def _late_arrivals(encoder: Any, trials: int) -> list[float]:
    latencies = []
    for trial in range(trials):
        first = asyncio.ensure_future(
            encoder.encode([f"first request {trial}: how are proteins folded"], "query")
        )
        await asyncio.sleep(0.002 + (trial % 12) * 0.001)
        start = time.perf_counter()
        await encoder.encode([f"late arrival {trial}"], "query", timeout=5)
        latencies.append((time.perf_counter() - start) * 1000)
        await first
        await asyncio.sleep(0.05)  # idle: nothing else comes in after the late one
    return latencies


async def _open_loop(encoder: Any, queries: list[str], rate: float, seconds: float) -> list[float]:
    rng = random.Random(1)
    start = time.perf_counter()
    due, latencies, tasks = 0.0, [], []

    async def one(i: int, due: float) -> None:
        await encoder.encode([queries[i % len(queries)]], "query", timeout=10)
        latencies.append((time.perf_counter() - start - due) * 1000)

    i = 0
    while True:
        due += rng.expovariate(rate)
        if due > seconds:
            break
        wait = start + due - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.ensure_future(one(i, due)))
        i += 1
    await asyncio.gather(*tasks)
    return latencies


async def _measure(url: str, queries: list[str], args: argparse.Namespace) -> dict[str, float]:
    from services.encoder.runtime.triton_client import TritonEncoder, TritonEncoderConfig

    encoder = await TritonEncoder.connect(TritonEncoderConfig(url, retries=0))
    try:
        for q in queries[:32]:  # warm-up
            await encoder.encode([q], "query")
        late = np.array(await _late_arrivals(encoder, args.trials))
        opened = np.array(await _open_loop(encoder, queries, args.rate, args.seconds))
        closed = await closed_loop(
            lambda i: encoder.encode([queries[i % len(queries)]], "query", timeout=10),
            16,
            args.seconds / 2,
        )
    finally:
        await encoder.close()
    return {
        "late_worst_ms": float(late.max()),
        "late_p99_ms": float(np.percentile(late, 99)),
        "open_p50_ms": float(np.percentile(opened, 50)),
        "open_p99_ms": float(np.percentile(opened, 99)),
        "open_max_ms": float(opened.max()),
        "closed_texts_per_s": closed.throughput,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        prog="python -m bench.triton_batcher", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--rate", type=float, default=15.0, help="open-loop arrivals/s (15)")
    parser.add_argument("--seconds", type=float, default=20.0, help="open-loop length (20 s)")
    parser.add_argument("--trials", type=int, default=60, help="late arrivals (60)")
    parser.add_argument("--queries", type=Path, default=None, help="BEIR queries.jsonl")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from services.encoder.build.export import export_onnx
    from services.encoder.build.repository import RepositoryConfig, generate_repository
    from services.encoder.model import default_model_dir
    from services.encoder.serve.triton_server import TritonServerConfig, run_triton
    from tests.support.processes import free_port

    queries = load_queries(args.queries)
    out: dict[str, Any] = {"rate": args.rate, "seconds": args.seconds, "trials": args.trials}
    with tempfile.TemporaryDirectory(prefix="gtr-bench-batcher-") as tmp:
        onnx_path = Path(tmp) / "model.onnx"
        export_onnx(default_model_dir(), onnx_path)
        for name, layout in LAYOUTS.items():
            repo = Path(tmp) / name
            generate_repository(onnx_path, repo, RepositoryConfig(**layout))
            cfg = TritonServerConfig(
                repo, grpc_port=free_port(), http_port=free_port(), metrics_port=free_port()
            )
            with run_triton(cfg, Path(tmp) / f"{name}.log") as handle:
                out[name] = asyncio.run(_measure(handle.grpc_url, queries, args))
            f = out[name]
            print(
                f"{name:>12}: late arrival worst {f['late_worst_ms']:.0f} ms "
                f"(p99 {f['late_p99_ms']:.0f}); open loop {args.rate:g}/s p50 "
                f"{f['open_p50_ms']:.1f} p99 {f['open_p99_ms']:.1f} max "
                f"{f['open_max_ms']:.0f} ms; closed loop {f['closed_texts_per_s']:.0f} texts/s",
                flush=True,
            )
    new = out["default"]
    for name in ("queue-policy", "priority-levels"):
        old = out[name]
        prefix = "" if name == "queue-policy" else "priority_"
        out[f"{prefix}late_worst_ratio"] = old["late_worst_ms"] / new["late_worst_ms"]
        out[f"{prefix}open_p99_ratio"] = old["open_p99_ms"] / new["open_p99_ms"]
        out[f"{prefix}throughput_ratio"] = new["closed_texts_per_s"] / old["closed_texts_per_s"]
        print(
            f"{name} ÷ default: late-arrival worst "
            f"{out[f'{prefix}late_worst_ratio']:.1f}x, open-loop p99 "
            f"{out[f'{prefix}open_p99_ratio']:.1f}x; default ÷ {name} throughput "
            f"{out[f'{prefix}throughput_ratio']:.2f}"
        )
    print(json_line(out))
    return out


if __name__ == "__main__":
    main()
