"""The generator's own overhead, measured against a trivial gRPC server (no work at all).

    python -m loadtest.overhead [--rate 200] [--seconds 5] [--max-rate 20000]

Starts ``loadtest.trivial_server`` in a process of its own, then measures in one run:

* ``roundtrip_p50_ms``/``_p99_ms``: a closed-loop client at concurrency 1, the bare
  cost of one gRPC call on this machine (the baseline);
* ``openloop_p50_ms``/``_p99_ms`` at ``--rate`` (Poisson): what the open-loop generator
  reports for the same server; ``added_p50_ms`` = open-loop p50 − round-trip p50 is what
  the generator's scheduling adds to every latency it reports;
* ``max_sustained_rate``: the highest offered rate (stepping by ``--factor`` from
  ``--start-rate``, down when already that is too much) at which the generator still
  kept its schedule (p99 lag within ``--lag-limit-ms``, nothing left unsent) against the
  trivial server: above it the generator, not the server, is the limit
  (``first_behind_rate``); ``max_rate_vs_roundtrip`` = that ÷ the concurrency-1
  closed-loop rate.

Prints a line per step, then one JSON line. Server and generator share this machine's
cores, so the ceiling is a lower bound.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from loadtest.closedloop import closed_loop
from loadtest.results import summarize
from loadtest.runner import RunConfig, run_open_loop
from loadtest.target import Target
from loadtest.workload import Workload, load_queries
from retrieval.v1 import search_pb2, search_pb2_grpc


@contextmanager
def trivial_server_process(service_ms: float = 0.0) -> Iterator[str]:
    """``python -m loadtest.trivial_server --port 0 [--service-ms N]`` in a child; yields
    its address."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "loadtest.trivial_server",
            "--port",
            "0",
            "--service-ms",
            str(service_ms),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("listening on "):
            raise RuntimeError(f"trivial server did not start: {line!r}")
        yield line.split()[-1]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


async def ceiling(
    target: Target,
    workload: Workload,
    args: argparse.Namespace,
    show: Callable[[dict[str, Any]], None],
) -> tuple[float, float | None]:
    """(highest rate kept, lowest rate fallen behind at): up by ``factor`` from the start
    rate while the generator keeps its schedule, down when already the start is too much."""
    rate, kept, behind, steps = args.start_rate, 0.0, None, 0
    while args.min_rate <= rate <= args.max_rate and steps < 16:
        run = RunConfig(rate=rate, duration_s=args.step_seconds, seed=steps)
        step = summarize(
            await run_open_loop(target, workload, run),
            slo_ms=1000.0,
            lag_limit_ms=args.lag_limit_ms,
        )
        steps += 1
        show(step)
        if step["generator_behind"]:
            behind = rate
            if kept:
                break
            rate /= args.factor
        else:
            kept = rate
            if behind is not None:
                break
            rate *= args.factor
        await asyncio.sleep(0.2)
    return kept, behind


async def measure(address: str, args: argparse.Namespace) -> dict[str, Any]:
    target = Target(address)
    workload = Workload(queries=load_queries(None))
    request = search_pb2.SearchRequest(query="overhead", k=10)
    async with target.aio_channel() as channel:
        stub = search_pb2_grpc.SearchServiceStub(channel)
        await channel.channel_ready()
        await closed_loop(lambda i: stub.Search(request, timeout=5), 1, 0.5)  # warm-up
        rt = await closed_loop(lambda i: stub.Search(request, timeout=5), 1, args.seconds)
    run = RunConfig(rate=args.rate, duration_s=args.seconds, seed=1)
    fixed = summarize(
        await run_open_loop(target, workload, run), slo_ms=1000.0, lag_limit_ms=args.lag_limit_ms
    )
    out: dict[str, Any] = {
        "roundtrip_p50_ms": rt.percentile_ms(50),
        "roundtrip_p99_ms": rt.percentile_ms(99),
        "roundtrip_rate": rt.throughput,
        "openloop_rate": args.rate,
        "openloop_p50_ms": fixed["p50_ms"],
        "openloop_p99_ms": fixed["p99_ms"],
        "openloop_lag_p99_ms": fixed["generator_lag_p99_ms"],
        "added_p50_ms": fixed["p50_ms"] - rt.percentile_ms(50),
    }
    print(
        f"round trip (closed loop, 1 client): p50 {out['roundtrip_p50_ms']:.3f} ms, "
        f"p99 {out['roundtrip_p99_ms']:.3f} ms, {rt.throughput:.0f}/s; open loop at "
        f"{args.rate:g}/s: p50 {fixed['p50_ms']:.3f} ms, p99 {fixed['p99_ms']:.3f} ms, "
        f"lag p99 {fixed['generator_lag_p99_ms']:.3f} ms",
        flush=True,
    )

    def show(step: dict[str, Any]) -> None:
        print(
            f"  offered {step['offered_rate']:9.1f}/s  achieved {step['achieved_rate']:9.1f}/s"
            f"  lag p99 {step['generator_lag_p99_ms']:7.3f} ms  p99 {step['p99_ms']:7.3f} ms"
            f"  {'behind' if step['generator_behind'] else 'keeps up'}",
            flush=True,
        )

    kept, behind = await ceiling(target, workload, args, show)
    out |= {
        "max_sustained_rate": kept,
        "first_behind_rate": behind,
        "max_rate_vs_roundtrip": kept / rt.throughput if rt.throughput else None,
        "lag_limit_ms": args.lag_limit_ms,
    }
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.overhead", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--rate", type=float, default=200.0, help="open-loop rate (200/s)")
    parser.add_argument("--seconds", type=float, default=5.0, help="per measurement (5)")
    parser.add_argument("--start-rate", type=float, default=100.0, help="ceiling search start")
    parser.add_argument("--min-rate", type=float, default=5.0, help="lowest rate tried (5)")
    parser.add_argument("--factor", type=float, default=1.5, help="rate step (1.5)")
    parser.add_argument("--step-seconds", type=float, default=3.0, help="per step (3)")
    parser.add_argument("--max-rate", type=float, default=20_000.0, help="ceiling (20000)")
    parser.add_argument(
        "--lag-limit-ms", type=float, default=5.0, help="p99 lag that counts as behind schedule (5)"
    )
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    with trivial_server_process() as address:
        out = asyncio.run(measure(address, args))
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}))
    return out


if __name__ == "__main__":
    main()
