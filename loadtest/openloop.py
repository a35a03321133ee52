"""Open-loop load generator for the gateway: requests on a fixed or Poisson schedule.

    python -m loadtest.openloop --target 127.0.0.1:50051 --rate 50 --duration 30
    python -m loadtest.openloop --rate 20 --mix search=8,batch=1,upsert=1 --rerank --rerank-depth 10
    python -m loadtest.openloop --sweep --rate 10 --factor 1.5 --step-seconds 10 --plot sweep.png

Requests leave at their scheduled times whether or not earlier ones came back, and
latency is measured from the scheduled time, so a stalled server cannot hide its tail
(no coordinated omission). Bounded by ``--duration`` and ``--requests``; traffic goes only
to ``--target`` (loopback by default). Prints a table and, last, one JSON line: offered
and achieved rate, p50/p90/p99/p99.9, errors by gRPC status code, partial results, SLO
attainment (share of all scheduled requests that succeeded within ``--slo-ms``; default
the end-to-end Search budget of ``--size``, with rerank if asked, from
services/common/slo.py) and the generator's own lag
(``generator_behind`` when its p99 lag is over ``--lag-limit-ms``). ``--sweep`` steps the
rate up from ``--rate`` until the SLO breaks and draws the percentiles and attainment
against offered rate (``--plot``). ``--processes N`` splits the schedule over N sender
processes for rates one event loop cannot keep. The generator's own ceiling:
``python -m loadtest.overhead``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from loadtest.budget import SIZES, default_slo_ms
from loadtest.processes import run_in_processes
from loadtest.results import json_line, summarize, table
from loadtest.runner import RunConfig
from loadtest.schedule import PROCESSES
from loadtest.sweep import SweepConfig, plot, sweep
from loadtest.target import add_target_arguments, target_from_args
from loadtest.workload import Workload, load_documents, load_queries, parse_mix


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.openloop",
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join((__doc__ or "").split("\n\n")[1:]),
    )
    add_target_arguments(p)
    g = p.add_argument_group("schedule")
    g.add_argument("--rate", type=float, default=20.0, help="requests/s (sweep: first rate)")
    g.add_argument("--duration", type=float, default=20.0, help="seconds of schedule (20)")
    g.add_argument("--requests", type=int, default=None, help="at most this many requests")
    g.add_argument("--arrivals", choices=PROCESSES, default="poisson", help="(poisson)")
    g.add_argument("--seed", type=int, default=0, help="seed of arrivals and requests (0)")
    g.add_argument("--timeout", type=float, default=5.0, help="gRPC deadline per request (5 s)")
    g.add_argument("--max-in-flight", type=int, default=10_000, help="cap (10000)")
    g.add_argument("--channels", type=int, default=1, help="HTTP/2 connections (1)")
    g.add_argument(
        "--processes",
        type=int,
        default=1,
        help="sender processes, each sending every N-th request of the schedule; the "
        "schedule starts once every one has connected (1)",
    )
    w = p.add_argument_group("workload")
    w.add_argument("--mix", default="search", help="ops and weights: search=8,batch=1,upsert=1")
    w.add_argument(
        "--queries",
        type=Path,
        default=None,
        help="BEIR queries.jsonl (default: SciFact's under ../shared/data, "
        "else the stdlib examples)",
    )
    w.add_argument(
        "--corpus",
        type=Path,
        default=None,
        help="BEIR corpus.jsonl for Upsert (default: SciFact's)",
    )
    w.add_argument("--k", type=int, default=10)
    w.add_argument("--rerank", action="store_true", help="ask for the cross-encoder rerank")
    w.add_argument(
        "--rerank-depth",
        type=int,
        default=0,
        help="rerank depth (0: the gateway picks by deadline)",
    )
    w.add_argument("--batch-size", type=int, default=8, help="queries per BatchSearch (8)")
    w.add_argument("--upsert-docs", type=int, default=1, help="documents per Upsert (1)")
    w.add_argument("--id-prefix", default="loadtest:", help="id prefix of upserted documents")
    s = p.add_argument_group("SLO and sweep")
    s.add_argument(
        "--size",
        choices=sorted(SIZES),
        default="minilm",
        help="encoder size whose end-to-end budget is the default --slo-ms",
    )
    s.add_argument("--slo-ms", type=float, default=None, help="latency budget (ms)")
    s.add_argument(
        "--lag-limit-ms",
        type=float,
        default=None,
        help="generator p99 lag above which it is behind (a quarter of the SLO)",
    )
    s.add_argument("--sweep", action="store_true", help="step the rate until the SLO breaks")
    s.add_argument("--factor", type=float, default=1.5, help="rate multiplier per step (1.5)")
    s.add_argument("--max-rate", type=float, default=10_000.0, help="sweep ceiling")
    s.add_argument("--step-seconds", type=float, default=10.0, help="seconds per step (10)")
    s.add_argument("--refine", type=int, default=2, help="bisection steps at the edge (2)")
    s.add_argument("--plot", type=Path, default=None, help="PNG of the sweep")
    s.add_argument("--title", default=None, help="plot title")
    return p


def workload_from_args(args: argparse.Namespace) -> Workload:
    mix = parse_mix(args.mix)
    docs = load_documents(args.corpus, limit=2000) if "upsert" in mix else []
    queries = load_queries(args.queries) if set(mix) & {"search", "batch"} else []
    return Workload(
        queries=queries,
        mix=mix,
        k=args.k,
        rerank=args.rerank,
        rerank_depth=args.rerank_depth,
        batch_size=args.batch_size,
        documents=docs,
        upsert_docs=args.upsert_docs,
        id_prefix=args.id_prefix,
    )


def run_config_from_args(args: argparse.Namespace) -> RunConfig:
    return RunConfig(
        rate=args.rate,
        duration_s=args.duration,
        count=args.requests,
        process=args.arrivals,
        seed=args.seed,
        timeout_s=args.timeout,
        max_in_flight=args.max_in_flight,
        channels=args.channels,
        processes=args.processes,
    )


def slo_from_args(args: argparse.Namespace) -> float:
    if args.slo_ms is not None:
        return float(args.slo_ms)
    return default_slo_ms(args.size, args.rerank)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    target = target_from_args(args)
    workload = workload_from_args(args)
    run = run_config_from_args(args)
    slo_ms = slo_from_args(args)
    if not args.sweep:
        summary = summarize(
            await run_in_processes(target, workload, run, run.processes), slo_ms, args.lag_limit_ms
        )
        print(table(summary))
        return summary
    cfg = SweepConfig(
        start_rate=args.rate,
        slo_ms=slo_ms,
        factor=args.factor,
        max_rate=args.max_rate,
        step_s=args.step_seconds,
        refine=args.refine,
        lag_limit_ms=args.lag_limit_ms,
    )

    def show(step: dict[str, Any]) -> None:
        print(
            f"rate {step['offered_rate']:8.2f}/s  achieved {step['achieved_rate']:8.2f}/s  "
            f"p50 {step['p50_ms']:8.1f}  p99 {step['p99_ms']:8.1f}  p99.9 "
            f"{step['p99_9_ms']:8.1f} ms  within SLO {step['slo_attainment']:7.2%}  "
            f"errors {step['errors'] or '-'}  lag p99 {step['generator_lag_p99_ms']:.2f} ms  "
            f"{'ok' if step['slo_met'] else 'BREAKS'}",
            flush=True,
        )

    result = await sweep(target, workload, run, cfg, on_step=show)
    if args.plot is not None:
        title = args.title or f"{args.mix}{' + rerank' if args.rerank else ''} → {target.address}"
        plot(result, args.plot, title)
        result["plot"] = str(args.plot)
    print(
        f"best rate within the SLO ({slo_ms:g} ms, p99 and >= 99 % attainment): "
        f"{result['best_rate']} /s; stopped by {result['stop_reason']}"
    )
    return result


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = asyncio.run(main_async(args))
    except (ValueError, OSError) as exc:  # bad input, unreadable file, unreachable target
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json_line(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
