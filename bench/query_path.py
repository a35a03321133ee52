"""Who should run a query's graph on CPU: the gateway or Triton? Paired, interleaved.

    .venv/bin/python -m bench.query_path [--rates 30,60,90] [--rounds 3] [--seconds 20]

This VM's cores change speed between runs: the same stack measured ~8.3 and ~11.3 ms
of CPU per search twenty minutes apart, with nothing else running. Two configurations
measured one after the other therefore compare the machine, not the configurations.
Here both serve at once, on the same Redis, Triton and shards: ``gtr-retrieval up
--no-rerank`` on the first ``--docs`` SciFact documents (its gateway runs the query
graph itself, ``--query-encoder gateway``, the default), and a second gateway started
with that gateway's own command line minus ``--query-repository`` (Triton embeds its
queries; other ports). Each round runs every rate against both, in turn (the order
alternates by round), Poisson, the same seeded queries (hybrid, the default mode) for
``--seconds``; an idle gateway costs nothing meanwhile. Per run: p50, p99, the share
within the 50 ms SLO and the stack's CPU per search (``/proc``; both gateways are
children here). The figure to keep is the ratio within a round (gateway ÷ Triton),
reported per rate as the median and range over rounds. One JSON line at the end.

``--compare event-loop`` pairs the same way the stack's gateway on uvloop (every server's
default, services/rpc/event_loop.py) against a second gateway started with its command
line plus ``--event-loop asyncio`` (the shards, Redis and Triton shared, on their
defaults); the ratios are then uvloop ÷ asyncio.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench import cpu_roles
from loadtest.budget import default_slo_ms
from loadtest.local_up import local_stack, write_corpus
from loadtest.results import summarize
from loadtest.runner import RunConfig, run_open_loop
from loadtest.target import Target
from loadtest.workload import DATA_DIR, Workload, load_queries
from tests.support.processes import free_port, wait_until

PATHS = ("gateway", "triton")
STACK_ROLES = ("gateway", "redis-server", "shards g1", "stub embed/1", "tritonserver")


def _without(argv: list[str], flag: str) -> list[str]:
    """``argv`` without ``flag`` and its value."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        else:
            out.append(arg)
    return out


def _with(argv: list[str], flag: str, value: str) -> list[str]:
    return [*_without(argv, flag), flag, value]


def _triton_queries(argv: list[str]) -> list[str]:
    return _without(argv, "--query-repository")


def _asyncio_loop(argv: list[str]) -> list[str]:
    return _with(argv, "--event-loop", "asyncio")


# --compare: the names of the stack's gateway and of the second one, and how the second's
# command line differs from the first's
COMPARISONS: dict[str, tuple[tuple[str, str], Callable[[list[str]], list[str]]]] = {
    "query-path": (PATHS, _triton_queries),
    "event-loop": (("uvloop", "asyncio"), _asyncio_loop),
}


def second_gateway(
    stack: dict[str, Any], log: Path, change: Callable[[list[str]], list[str]] = _triton_queries
) -> tuple[subprocess.Popen[bytes], str]:
    """The stack's gateway command line changed by ``change``, on free ports."""
    (child,) = [c for c in stack["children"] if c["name"] == "gateway"]
    raw = Path(f"/proc/{child['pid']}/cmdline").read_bytes()
    argv = change([a.decode() for a in raw.split(b"\0") if a])
    argv = _without(argv, "--http-port")
    port = free_port()
    argv = _with(argv, "--port", str(port))
    argv = _with(argv, "--metrics-port", str(free_port()))
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    return proc, f"127.0.0.1:{port}"


async def _serves(target: Target, queries: list[str]) -> bool:
    cfg = RunConfig(rate=20.0, duration_s=0.5, seed=1)
    records = await run_open_loop(target, Workload(queries=queries), cfg)
    return all(code == "OK" for code in records.codes)


def _answers(target: Target, queries: list[str]) -> bool:
    return asyncio.run(_serves(target, queries))


def one_run(
    target: Target, queries: list[str], rate: float, seconds: float, seed: int, slo_ms: float
) -> dict[str, Any]:
    root = os.getpid()
    before, start = cpu_roles.sample(root), time.monotonic()
    cfg = RunConfig(rate=rate, duration_s=seconds, seed=seed)
    summary = summarize(asyncio.run(run_open_loop(target, Workload(queries=queries), cfg)), slo_ms)
    after = cpu_roles.sample(root)
    stack_cpu_s = sum(after.get(r, 0.0) - before.get(r, 0.0) for r in STACK_ROLES)
    ok = max(1, summary["ops"].get("search", 0) - sum(summary["errors"].values()))
    return {
        "rate": rate,
        "achieved_rate": summary["achieved_rate"],
        "p50_ms": summary["p50_ms"],
        "p99_ms": summary["p99_ms"],
        "slo_attainment": summary["slo_attainment"],
        "errors": summary["errors"],
        "cpu_ms_per_search": 1000 * stack_cpu_s / ok,
        "wall_s": time.monotonic() - start,
    }


def _ratios(
    rounds: list[dict[str, dict[str, Any]]], key: str, names: tuple[str, str] = PATHS
) -> dict[str, float]:
    values = np.array([r[names[0]][key] / r[names[1]][key] for r in rounds])
    return {
        "median": float(np.median(values)),
        "min": float(values.min()),
        "max": float(values.max()),
    }


def measure(stack_json: Path, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    stack = json.loads(stack_json.read_text(encoding="utf-8"))
    queries = load_queries(args.data / "queries.jsonl")
    names, change = COMPARISONS[args.compare]
    proc, address = second_gateway(stack, log_dir / f"gateway-{names[1]}.log", change)
    try:
        targets = {names[0]: Target(stack["gateway"]), names[1]: Target(address)}
        for target in targets.values():
            wait_until(functools.partial(_answers, target, queries), "serves", 120)
        slo = default_slo_ms("minilm")
        per_rate: dict[str, Any] = {}
        for rate in args.rates:
            rounds: list[dict[str, dict[str, Any]]] = []
            for n in range(args.rounds):
                order = names if n % 2 == 0 else names[::-1]
                pair = {
                    path: one_run(targets[path], queries, rate, args.seconds, 100 + n, slo)
                    for path in order
                }
                rounds.append(pair)
                print(
                    f"rate {rate:5.1f}/s round {n + 1}: "
                    + "  ".join(
                        f"{p}: p50 {pair[p]['p50_ms']:5.1f} p99 {pair[p]['p99_ms']:5.1f} ms, "
                        f"within {pair[p]['slo_attainment']:.2%}, "
                        f"CPU {pair[p]['cpu_ms_per_search']:.2f} ms"
                        for p in names
                    ),
                    flush=True,
                )
            over = f"{names[0]}_over_{names[1]}"
            per_rate[f"{rate:g}"] = {
                "rounds": rounds,
                f"p50_{over}": _ratios(rounds, "p50_ms", names),
                f"p99_{over}": _ratios(rounds, "p99_ms", names),
                f"cpu_{over}": _ratios(rounds, "cpu_ms_per_search", names),
            }
        return per_rate
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.query_path", description=(__doc__ or "").split("\n\n")[0]
    )
    p.add_argument("--data", type=Path, default=DATA_DIR / "scifact", help="BEIR folder")
    p.add_argument("--docs", type=int, default=1500, help="documents ingested (1500)")
    p.add_argument(
        "--rates",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[30.0, 60.0, 90.0],
        help="offered rates, searches/s (30,60,90)",
    )
    p.add_argument("--rounds", type=int, default=3, help="rounds per rate (3)")
    p.add_argument("--seconds", type=float, default=20.0, help="seconds per run (20)")
    p.add_argument("--startup-timeout", type=float, default=1800.0, help="for `up` (s)")
    p.add_argument(
        "--compare",
        choices=sorted(COMPARISONS),
        default="query-path",
        help="query-path (default): the gateway's own query graph against Triton's; "
        "event-loop: the gateway on uvloop (the default) against --event-loop asyncio",
    )
    p.add_argument("--out", type=Path, default=None, help="also write the JSON line here")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="gtr-query-path-") as tmp_name:
        tmp = Path(tmp_name)
        corpus = write_corpus(args.data, tmp / "corpus.jsonl", args.docs)
        load_before = os.getloadavg()
        with local_stack(tmp / "run", args.startup_timeout, corpus, ("--no-rerank",)) as st:
            per_rate = measure(st, args, tmp)
        out = {
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
            "compare": args.compare,
            "rates": per_rate,
            "command": "python -m bench.query_path " + " ".join(argv or sys.argv[1:]),
        }
    for rate, one in per_rate.items():
        print(
            f"rate {rate}/s, {' ÷ '.join(COMPARISONS[args.compare][0])} over {args.rounds} "
            "rounds (median [min, max]): "
            + "; ".join(
                f"{k.split('_')[0]} {v['median']:.2f} [{v['min']:.2f}, {v['max']:.2f}]"
                for k, v in one.items()
                if k != "rounds"
            )
        )
    line = json.dumps(out)
    if args.out is not None:
        args.out.write_text(line + "\n", encoding="utf-8")
    print(line)
    return out


if __name__ == "__main__":
    from services.stack.children import sigterm_as_interrupt

    with sigterm_as_interrupt():  # SIGTERM (a `timeout`) stops the stack it started too
        main()
