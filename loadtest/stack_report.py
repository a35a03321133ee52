"""The load-test report of the local stack, in one command (docs/performance.md quotes it).

    .venv/bin/python -m loadtest.stack_report --run-dir /tmp/c-run --img-dir docs/img

Starts ``gtr-retrieval up --run-dir DIR --port 0 --shards 2`` (the default model, the
reranker started), waits until it serves, and measures in one run:

1. the generator's overhead against a trivial gRPC server (:mod:`loadtest.overhead`);
2. an open-loop sweep of Search, rerank off, against the end-to-end budget of the
   default model (50 ms, services/common/slo.py), plotted to ``IMG_DIR/load-sweep-rerank-off.png``;
3. the same with rerank on at depth 10, the smallest depth the gateway's table knows,
   against the budget of a Search with rerank (250 ms), plotted to
   ``IMG_DIR/load-sweep-rerank-on.png``;
4. gateway Search throughput ÷ Triton encode-only throughput, same queries, same
   concurrency (:mod:`loadtest.bottleneck`);

Each sweep climbs from its first rate by ``--factor`` until the SLO breaks, or steps down
(at most four times) when already the first rate breaks it. Then it stops the stack and
prints the figures the report quotes, the load average of the
machine before and after, and one JSON line. ``--stack-json`` measures a stack that is
already running instead. On a machine shared with other work the absolute figures are
low and noisy: re-run it on a quiet machine to replace them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import IO, Any

from loadtest import bottleneck, overhead
from loadtest.budget import default_slo_ms
from loadtest.runner import RunConfig
from loadtest.sweep import SweepConfig, plot, sweep
from loadtest.target import Target, target_from_stack
from loadtest.workload import Workload, load_queries

RERANK_DEPTH = 10


@contextmanager
def local_stack(run_dir: Path, timeout_s: float) -> Iterator[Path]:
    """``gtr-retrieval up`` in a child process until it serves; yields its stack.json."""
    cmd = [
        sys.executable,
        "-m",
        "services.cli.main",
        "up",
        "--run-dir",
        str(run_dir),
        "--port",
        "0",
        "--shards",
        "2",
    ]
    print("$ " + " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        for line in proc.stdout:
            if line.startswith("[up]"):
                print("  " + line.rstrip(), flush=True)
            if "[up] serving" in line:
                break
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"the stack did not come up (last line: {line.strip()!r})")
        else:
            raise RuntimeError(f"the stack exited with {proc.wait()} before serving")
        # Keep reading its output: a full pipe would block the stack mid-measurement.
        threading.Thread(target=_discard, args=(proc.stdout,), daemon=True).start()
        yield run_dir / "stack.json"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _discard(stream: IO[str]) -> None:
    for _ in stream:
        pass


def loadavg() -> tuple[float, float, float]:
    return os.getloadavg()


async def run_sweep(
    target: Target,
    workload: Workload,
    cfg: SweepConfig,
    png: Path,
    title: str,
    knee: bool = False,
) -> dict[str, Any]:
    def show(s: dict[str, Any]) -> None:
        print(
            f"  rate {s['offered_rate']:7.2f}/s achieved {s['achieved_rate']:7.2f}/s  "
            f"p50 {s['p50_ms']:7.1f} p90 {s['p90_ms']:7.1f} p99 {s['p99_ms']:7.1f} "
            f"p99.9 {s['p99_9_ms']:7.1f} ms  within {s['slo_attainment']:7.2%}  "
            f"n {s['requests']}  errors {s['errors'] or '-'}  partial {s['partial']}  "
            f"rerank skipped {s['rerank_skipped']}  "
            f"lag p99 {s['generator_lag_p99_ms']:.1f} ms  "
            f"{'ok' if s['slo_met'] else 'BREAKS'}",
            flush=True,
        )

    run = RunConfig(rate=1.0, duration_s=1.0, seed=11)
    result = await sweep(target, workload, run, cfg, show)
    if result["best_rate"] is None and knee:
        # No rate met the SLO: climb from the first rate while the gateway keeps up, so
        # the plot shows where it saturates (its steps keep their SLO verdicts).
        print("  no rate met the SLO; climbing while the gateway keeps up", flush=True)
        climb = replace(cfg, criterion="throughput", min_rate=cfg.start_rate, refine=0)
        extra = await sweep(target, workload, replace(run, seed=97), climb, show)
        result["steps"] += extra["steps"]
        result["max_kept_up_rate"] = max(
            (r for r in (result["max_kept_up_rate"], extra["max_kept_up_rate"]) if r),
            default=None,
        )
    plot(result, png, title)
    result["plot"] = str(png)
    print(
        f"  best rate within {cfg.slo_ms:g} ms (p99, >= 99 %): {result['best_rate']} /s "
        f"(stopped by {result['stop_reason']}) -> {png}",
        flush=True,
    )
    return result


def _sweep_config(
    args: argparse.Namespace, start_rate: float, step_s: float, slo_ms: float
) -> SweepConfig:
    """Climb from ``start_rate`` by ``--factor``; step down at most four times."""
    return SweepConfig(
        start_rate=start_rate,
        slo_ms=slo_ms,
        factor=args.factor,
        min_rate=start_rate / args.factor**4,
        step_s=step_s,
        refine=args.refine,
    )


def measure(stack_json: Path, args: argparse.Namespace) -> dict[str, Any]:
    stack = json.loads(stack_json.read_text(encoding="utf-8"))
    target = target_from_stack(stack, token=os.environ.get("GTR_TOKEN") or None)
    queries = load_queries(args.queries)
    out: dict[str, Any] = {"loadavg_before": loadavg(), "gateway": stack["gateway"]}

    print("\n== generator overhead (trivial gRPC server)", flush=True)
    with overhead.trivial_server_process() as address:
        ov_args = overhead.build_parser().parse_args([])
        out["overhead"] = asyncio.run(overhead.measure(address, ov_args))

    print("\n== sweep, rerank off", flush=True)
    slo_off = default_slo_ms("minilm")
    off = _sweep_config(args, args.start_rate, args.step_seconds, slo_off)
    out["rerank_off"] = asyncio.run(
        run_sweep(
            target,
            Workload(queries=queries),
            off,
            args.img_dir / "load-sweep-rerank-off.png",
            f"Search, rerank off, 2 shards, MiniLM (SLO {slo_off:g} ms)",
            knee=True,
        )
    )

    print(f"\n== sweep, rerank on (depth {RERANK_DEPTH})", flush=True)
    slo_on = default_slo_ms("minilm", rerank=True)
    on = _sweep_config(args, args.rerank_start_rate, args.rerank_step_seconds, slo_on)
    rerank = Workload(queries=queries, rerank=True, rerank_depth=RERANK_DEPTH)
    out["rerank_on"] = asyncio.run(
        run_sweep(
            target,
            rerank,
            on,
            args.img_dir / "load-sweep-rerank-on.png",
            f"Search + CELI rerank depth {RERANK_DEPTH}, 2 shards (SLO {slo_on:g} ms)",
        )
    )

    print(f"\n== gateway ÷ Triton encode-only, concurrency {args.concurrency}", flush=True)
    b_args = bottleneck.build_parser().parse_args(
        ["--concurrency", str(args.concurrency), "--rounds", str(args.rounds)]
    )
    out["bottleneck"] = bottleneck.measure_placements(
        target, stack["triton_grpc"], queries, b_args, stack
    )
    out["loadavg_after"] = loadavg()
    return out


def summary_lines(out: dict[str, Any]) -> list[str]:
    ov, off, on, bn = out["overhead"], out["rerank_off"], out["rerank_on"], out["bottleneck"]
    best_off = off["best_rate"] or 0.0
    knee_off = off["max_kept_up_rate"] or 0.0
    lines = [
        f"load average before {out['loadavg_before']}, after {out['loadavg_after']}",
        f"generator: max sustained {ov['max_sustained_rate']:.0f}/s against the trivial server; "
        f"adds {ov['added_p50_ms']:.2f} ms at p50 (open loop {ov['openloop_p50_ms']:.2f} ms vs "
        f"round trip {ov['roundtrip_p50_ms']:.2f} ms); "
        f"{ov['max_sustained_rate'] / max(best_off, knee_off, 1e-9):.1f}x the gateway's "
        f"best rate (or the highest it kept up with, {knee_off:g}/s)",
        f"rerank off: best rate {off['best_rate']}/s within {off['slo_ms']:g} ms "
        f"(p99 {off['best_p99_ms']}, attainment {off['best_attainment']}); first failing "
        f"{off['first_failing_rate']}; highest rate it kept up with (achieved >= 90 % of "
        f"scheduled, <= 1 % errors) {off['max_kept_up_rate']}/s",
        f"rerank on:  best rate {on['best_rate']}/s within {on['slo_ms']:g} ms "
        f"(p99 {on['best_p99_ms']}, attainment {on['best_attainment']}); first failing "
        f"{on['first_failing_rate']}; highest rate it kept up with {on['max_kept_up_rate']}/s",
    ]
    for name in ("shared", "split"):
        if name not in bn:
            continue
        one = bn[name]
        cpus = f", Triton on CPUs {one['encoder_cpus']}" if name == "split" else ""
        lines.append(
            f"{name}{cpus}: gateway {one['gateway_searches_per_s']:.1f} searches/s ÷ Triton "
            f"{one['triton_encodes_per_s']:.1f} encodes/s at concurrency {bn['concurrency']}"
            f" = {one['ratio']:.3f} (rounds {one['rounds_ratio_min']:.3f}–"
            f"{one['rounds_ratio_max']:.3f}; goal ≥ 0.8)"
        )
    if "shared" in bn:
        lines.append(
            "open loop: highest rate kept up with ÷ encode-only (shared) = "
            f"{knee_off / bn['shared']['triton_encodes_per_s']:.3f}"
        )
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.stack_report", description=(__doc__ or "").split("\n\n")[0]
    )
    p.add_argument(
        "--run-dir",
        type=Path,
        default=Path("/tmp/gtr-load-report"),
        help="run dir of the stack it starts (default /tmp/gtr-load-report)",
    )
    p.add_argument(
        "--stack-json",
        type=Path,
        default=None,
        help="measure this running stack instead of starting one",
    )
    p.add_argument("--img-dir", type=Path, default=Path("docs/img"), help="where PNGs go")
    p.add_argument("--queries", type=Path, default=None, help="BEIR queries.jsonl")
    p.add_argument("--start-rate", type=float, default=5.0, help="rerank off: first rate (5)")
    p.add_argument(
        "--rerank-start-rate", type=float, default=0.5, help="rerank on: first rate (0.5)"
    )
    p.add_argument("--factor", type=float, default=1.5, help="rate step (1.5)")
    p.add_argument("--step-seconds", type=float, default=12.0, help="rerank off (12)")
    p.add_argument("--rerank-step-seconds", type=float, default=30.0, help="rerank on (30)")
    p.add_argument("--refine", type=int, default=2, help="bisection steps at the edge (2)")
    p.add_argument("--concurrency", type=int, default=16, help="bottleneck ratio (16)")
    p.add_argument("--rounds", type=int, default=3, help="bottleneck alternations (3)")
    p.add_argument("--startup-timeout", type=float, default=1800.0, help="for `up` (s)")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    if args.stack_json is not None:
        out = measure(args.stack_json, args)
    else:
        with local_stack(args.run_dir, args.startup_timeout) as stack_json:
            out = measure(stack_json, args)
    out["command"] = "python -m loadtest.stack_report " + " ".join(argv or sys.argv[1:])
    print("\n== report")
    for line in summary_lines(out):
        print(line)
    print(json.dumps(out, default=lambda v: None if v != v else v))
    return out


if __name__ == "__main__":
    main()
