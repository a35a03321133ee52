"""The load-test report of the local stack, in one command (docs/performance.md quotes it).

    .venv/bin/python -m loadtest.stack_report --img-dir docs/img

Starts ``gtr-retrieval up --run-dir DIR --port 0 --shards 2 --corpus C --query-precision
P`` (the default model, the reranker started; ``C``: the first ``--docs`` SciFact
documents, so that the floor below searches the same ones; ``P``: ``--query-precision``,
int8 as ``up``'s default, the floor's query graph too), waits until it serves, and
measures in one run:

1. the generator's overhead against a trivial gRPC server (:mod:`loadtest.overhead`);
2. for **hybrid** (the default mode) and **dense**, rerank off:
   a. the closed-loop ceiling: searches/s ``--concurrency`` callers get through, and the
      CPU every process of the stack used per search (``/proc``, :mod:`bench.cpu_roles`;
      the generator excluded);
   b. an open-loop sweep (Poisson) against the end-to-end budget of the default model
      (50 ms, services/common/slo.py: p99 within it and ≥ 99 % of the searches),
      plotted to ``IMG_DIR/load-sweep-<mode>.png``; its best rate ÷ the ceiling is
      ``slo_rate_over_ceiling``;
3. the floor (:mod:`bench.floor`): the same searches of the same documents in one thread
   with no RPC, built first and measured before the stack starts and after it stops (the
   mean of both is the floor, ``floor_drift`` their ratio: this VM's cores change speed
   within a run); the stack's CPU per search ÷ the floor's is
   ``cpu_per_search_over_floor``;
4. unless ``--no-rerank``: the sweep with rerank on at depth 10, the smallest depth the
   gateway's table knows, against the budget of a Search with rerank (250 ms);
5. unless ``--no-bottleneck``: gateway Search throughput ÷ Triton encode-only throughput,
   same queries, same concurrency (:mod:`loadtest.bottleneck`);
6. unless ``--no-baseline``: hybrid's ceiling and sweep again on the same run dir with
   Triton embedding the queries (``up --query-encoder triton``, the path before the
   gateway ran the query graph itself): ``hybrid_slo_rate_over_baseline``.

Each sweep climbs from its first rate by ``--factor`` until the SLO breaks, or steps down
(at most four times) when already the first rate breaks it. Then it stops the stack and
prints the figures the report quotes, the load average of the machine before and after,
the cores the rest of the machine used meanwhile (``other_cores``: another job's load)
and the hypervisor took (``steal_cores``, during the stack's or the floor's part, the
larger), ``loaded`` above a quarter core, a tenth of steal or a floor drift beyond
1.25×, and one JSON line, whose
top level carries the default mode's ``hybrid_slo_rate``, ``slo_rate_over_ceiling`` and
``cpu_per_search_over_floor`` (issue #34). ``--stack-json`` measures a stack that is
already running instead (no CPU figures then: its processes are not this one's children).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench import cpu_roles
from bench import floor as floor_bench
from loadtest import bottleneck, overhead
from loadtest.budget import default_slo_ms
from loadtest.local_up import SHARDS, local_stack, write_corpus
from loadtest.runner import RunConfig
from loadtest.sweep import SweepConfig, plot, sweep
from loadtest.target import Target, target_from_stack
from loadtest.workload import DATA_DIR, Mode, Workload, load_queries

RERANK_DEPTH = 10
MODES: tuple[Mode, ...] = ("hybrid", "dense")
# Cores the rest of the machine may use during a run that still counts as quiet.
LOADED_OTHER_CORES = 0.25
# ... and the hypervisor's steal (/proc/stat) above which the cores ran slow for us
STEAL_CORES = 0.1
# ... and the floor's drift (after the stack ÷ before it) beyond which the cores changed
# speed under the run (seen: 4.1 → 8.7 ms with no steal and nothing else running)
FLOOR_DRIFT = 1.25


def loadavg() -> tuple[float, float, float]:
    return os.getloadavg()


async def run_sweep(
    target: Target,
    workload: Workload,
    cfg: SweepConfig,
    png: Path,
    title: str,
    knee: bool = False,
    channels: int = 1,
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

    run = RunConfig(rate=1.0, duration_s=1.0, seed=11, channels=channels)
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


def _cpu_window(root: int, before: dict[str, float], seconds: float) -> dict[str, float]:
    """Cores by role since ``before`` (:func:`bench.cpu_roles.sample`) over ``seconds``,
    with ``other``: what the rest of the machine used meanwhile."""
    after = cpu_roles.sample(root)
    used = {key: max(0.0, after[key] - before.get(key, 0.0)) / seconds for key in after}
    return {key: round(v, 3) for key, v in sorted(cpu_roles.with_other(used).items())}


def measure_mode(
    target: Target,
    stack: dict[str, Any],
    queries: list[str],
    mode: Mode,
    args: argparse.Namespace,
    tag: str = "",
) -> dict[str, Any]:
    """The closed-loop ceiling with the stack's CPU per search, then the open-loop sweep
    (``tag``: the baseline's, in the plot's name and title)."""
    print(f"\n== {mode}{tag}: closed-loop ceiling, {args.concurrency} callers", flush=True)
    ceiling = floor_bench.measure_stack(
        target.address,
        queries,
        mode,
        10,
        args.ceiling_seconds,
        args.concurrency,
        target.credentials(),
        target.metadata,
    )
    if not any(v > 0 for v in ceiling["roles_cpu_ms_per_search"].values()):
        ceiling["cpu_ms_per_search"] = None  # not our children (--stack-json): not measured
    print(
        f"  {ceiling['searches_per_s']:.1f} searches/s ({ceiling['failed']} failed), "
        f"stack CPU {ceiling['cpu_ms_per_search']} ms per search "
        f"{ceiling['roles_cpu_ms_per_search']}",
        flush=True,
    )
    print(f"\n== {mode}{tag}: open-loop sweep, rerank off", flush=True)
    slo = default_slo_ms("minilm")
    cfg = _sweep_config(args, args.start_rate, args.step_seconds, slo)
    sweep_result = asyncio.run(
        run_sweep(
            target,
            Workload(queries=queries, mode=mode),
            cfg,
            args.img_dir / f"load-sweep-{mode}{tag.replace(' ', '-')}.png",
            f"Search ({mode}{tag}), rerank off, {SHARDS} shards, MiniLM (SLO {slo:g} ms)",
            knee=True,
        )
    )
    best = sweep_result["best_rate"]
    return {
        "ceiling": ceiling,
        "sweep": sweep_result,
        "slo_rate": best,
        "slo_rate_over_ceiling": (best or 0.0) / ceiling["searches_per_s"]
        if ceiling["searches_per_s"]
        else None,
    }


def measure_baseline(stack_json: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The default mode again with Triton embedding the queries (``up --query-encoder
    triton``, as before the gateway ran them): the before of the same run."""
    stack = json.loads(stack_json.read_text(encoding="utf-8"))
    target = target_from_stack(stack, token=os.environ.get("GTR_TOKEN") or None)
    queries = load_queries(args.queries)
    return measure_mode(target, stack, queries, "hybrid", args, tag=" triton-queries")


def floor_modes(floor: floor_bench.Floor, queries: list[str], when: str) -> dict[str, Any]:
    """bench.floor's CPU per search of each mode (setup not measured)."""
    out: dict[str, Any] = {m: floor_bench.measure_floor(floor, queries, m, 10) for m in MODES}
    for m in MODES:
        print(f"  {m} ({when}): {out[m]['cpu_ms_per_search']:.2f} ms CPU per search", flush=True)
    return out


def floor_summary(first: dict[str, Any], last: dict[str, Any]) -> dict[str, Any]:
    """The floor of each mode: the mean of its runs before and after the stack (each
    with its figures), so that a machine whose speed drifts over the run is charged
    evenly to both sides of the ratio; the drift (after ÷ before) says how much it did."""
    out: dict[str, Any] = {}
    for m in MODES:
        before, after = first[m]["cpu_ms_per_search"], last[m]["cpu_ms_per_search"]
        out[m] = {**last[m], "cpu_ms_per_search": (before + after) / 2}
        out[m].update(before_ms=before, after_ms=after)
    return out


def measure(stack_json: Path, args: argparse.Namespace, corpus: Path | None) -> dict[str, Any]:
    stack = json.loads(stack_json.read_text(encoding="utf-8"))
    target = target_from_stack(stack, token=os.environ.get("GTR_TOKEN") or None)
    queries = load_queries(args.queries)
    root, start = os.getpid(), time.monotonic()
    cpu_before = cpu_roles.sample(root)
    out: dict[str, Any] = {"loadavg_before": loadavg(), "gateway": stack["gateway"]}

    print("\n== generator overhead (trivial gRPC server)", flush=True)
    with overhead.trivial_server_process() as address:
        ov_args = overhead.build_parser().parse_args([])
        out["overhead"] = asyncio.run(overhead.measure(address, ov_args))

    out["modes"] = {m: measure_mode(target, stack, queries, m, args) for m in MODES}

    if not args.no_rerank:
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
                f"Search + CELI rerank depth {RERANK_DEPTH}, {SHARDS} shards (SLO {slo_on:g} ms)",
            )
        )

    if not args.no_bottleneck:
        print(f"\n== gateway ÷ Triton encode-only, concurrency {args.concurrency}", flush=True)
        b_args = bottleneck.build_parser().parse_args(
            ["--concurrency", str(args.concurrency), "--rounds", str(args.rounds)]
        )
        out["bottleneck"] = bottleneck.measure_placements(
            target, stack["triton_grpc"], queries, b_args, stack
        )
    out["cores"] = _cpu_window(root, cpu_before, time.monotonic() - start)
    out["loadavg_after"] = loadavg()
    return out


def add_ratios(out: dict[str, Any]) -> None:
    """The floor ratios per mode, and the default mode's figures at the top level."""
    for m, one in out["modes"].items():
        stack_ms = one["ceiling"]["cpu_ms_per_search"]
        floor_ms = out.get("floor", {}).get(m, {}).get("cpu_ms_per_search")
        one["floor_cpu_ms_per_search"] = floor_ms
        one["cpu_per_search_over_floor"] = (
            stack_ms / floor_ms if stack_ms is not None and floor_ms else None
        )
    hybrid = out["modes"]["hybrid"]
    out["hybrid_slo_rate"] = hybrid["slo_rate"]
    out["slo_rate_over_ceiling"] = hybrid["slo_rate_over_ceiling"]
    out["cpu_per_search_over_floor"] = hybrid["cpu_per_search_over_floor"]
    base = out.get("baseline_triton_queries")
    if base is not None:
        out["baseline_hybrid_slo_rate"] = base["slo_rate"]
        out["hybrid_slo_rate_over_baseline"] = (
            (hybrid["slo_rate"] or 0.0) / base["slo_rate"] if base["slo_rate"] else None
        )
    out["other_cores"] = out["cores"].get("other", 0.0)
    out["steal_cores"] = max(out["cores"].get("steal", 0.0), out.get("floor_steal_cores", 0.0))
    drift = out.get("floor_drift", 1.0)
    out["loaded"] = (
        out["other_cores"] > LOADED_OTHER_CORES
        or out["steal_cores"] > STEAL_CORES
        or not 1 / FLOOR_DRIFT <= drift <= FLOOR_DRIFT
    )


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def summary_lines(out: dict[str, Any]) -> list[str]:
    ov = out["overhead"]
    lines = [
        f"load average before {out['loadavg_before']}, after {out['loadavg_after']}; "
        f"the rest of the machine used {out['other_cores']:.2f} cores meanwhile, the "
        f"hypervisor stole {out['steal_cores']:.2f} (stack or floor, the larger); the "
        f"floor after the stack ÷ before it {out.get('floor_drift', 1.0):.2f}"
        + (" (LOADED: not a quiet machine's figures)" if out["loaded"] else ""),
        f"generator: max sustained {ov['max_sustained_rate']:.0f}/s against the trivial "
        f"server; adds {ov['added_p50_ms']:.2f} ms at p50",
        "mode   | ceiling/s | SLO rate/s | SLO ÷ ceiling | stack CPU ms | floor CPU ms | ÷ floor",
    ]
    for m, one in out["modes"].items():
        c = one["ceiling"]
        lines.append(
            f"{m:6} | {c['searches_per_s']:9.1f} | {_fmt(one['slo_rate'], '10.1f')} | "
            f"{_fmt(one['slo_rate_over_ceiling'], '13.3f')} | "
            f"{_fmt(c['cpu_ms_per_search'], '12.2f')} | "
            f"{_fmt(one['floor_cpu_ms_per_search'], '12.2f')} | "
            f"{_fmt(one['cpu_per_search_over_floor'], '.2f')}"
        )
    lines.append(
        f"hybrid (the default): hybrid_slo_rate {out['hybrid_slo_rate']}/s (goal >= 150), "
        f"slo_rate_over_ceiling {_fmt(out['slo_rate_over_ceiling'], '.3f')} (goal >= 0.7), "
        f"cpu_per_search_over_floor {_fmt(out['cpu_per_search_over_floor'])} (goal <= 1.6)"
    )
    base = out.get("baseline_triton_queries")
    if base is not None:
        c = base["ceiling"]
        lines.append(
            f"baseline, Triton embedding the queries (hybrid): ceiling "
            f"{c['searches_per_s']:.1f}/s, SLO rate {_fmt(base['slo_rate'], '.1f')}/s, stack "
            f"CPU {_fmt(c['cpu_ms_per_search'])} ms per search; SLO rate now ÷ baseline "
            f"{_fmt(out.get('hybrid_slo_rate_over_baseline'))}"
        )
    on = out.get("rerank_on")
    if on is not None:
        lines.append(
            f"rerank on: best rate {on['best_rate']}/s within {on['slo_ms']:g} ms "
            f"(p99 {on['best_p99_ms']}); first failing {on['first_failing_rate']}"
        )
    bn = out.get("bottleneck", {})
    for name in ("shared", "split"):
        if name not in bn:
            continue
        one = bn[name]
        cpus = f", Triton on CPUs {one['encoder_cpus']}" if name == "split" else ""
        lines.append(
            f"{name}{cpus}: gateway {one['gateway_searches_per_s']:.1f} searches/s ÷ Triton "
            f"{one['triton_encodes_per_s']:.1f} encodes/s at concurrency {bn['concurrency']}"
            f" = {one['ratio']:.3f} (rounds {one['rounds_ratio_min']:.3f}–"
            f"{one['rounds_ratio_max']:.3f})"
        )
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.stack_report", description=(__doc__ or "").split("\n\n")[0]
    )
    p.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="run dir of the stack it starts (default: a new temporary one, removed after)",
    )
    p.add_argument(
        "--stack-json",
        type=Path,
        default=None,
        help="measure this running stack instead of starting one (no CPU or floor figures)",
    )
    p.add_argument(
        "--data",
        type=Path,
        default=DATA_DIR / "scifact",
        help="BEIR folder: the stack's corpus (its first --docs documents) and the queries",
    )
    p.add_argument("--docs", type=int, default=1500, help="documents ingested (1500)")
    p.add_argument("--img-dir", type=Path, default=Path("docs/img"), help="where PNGs go")
    p.add_argument("--queries", type=Path, default=None, help="BEIR queries.jsonl")
    p.add_argument("--start-rate", type=float, default=20.0, help="rerank off: first rate (20)")
    p.add_argument(
        "--rerank-start-rate", type=float, default=0.5, help="rerank on: first rate (0.5)"
    )
    p.add_argument("--factor", type=float, default=1.5, help="rate step (1.5)")
    p.add_argument("--step-seconds", type=float, default=40.0, help="rerank off (40)")
    p.add_argument("--rerank-step-seconds", type=float, default=30.0, help="rerank on (30)")
    p.add_argument("--refine", type=int, default=2, help="bisection steps at the edge (2)")
    p.add_argument(
        "--concurrency", type=int, default=16, help="closed-loop callers: ceiling, bottleneck"
    )
    p.add_argument("--ceiling-seconds", type=float, default=20.0, help="closed loop per mode (20)")
    p.add_argument("--rounds", type=int, default=3, help="bottleneck alternations (3)")
    p.add_argument("--no-rerank", action="store_true", help="skip the rerank-on sweep")
    p.add_argument("--no-bottleneck", action="store_true", help="skip the bottleneck ratio")
    p.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip the baseline: hybrid again with Triton embedding the queries (`up "
        "--query-encoder triton` on the same run dir)",
    )
    p.add_argument("--startup-timeout", type=float, default=1800.0, help="for `up` (s)")
    p.add_argument(
        "--query-precision",
        choices=["int8", "fp32"],
        default="int8",
        help="the stack's query tower (`up --query-precision`) and the floor's: int8 (up's "
        "default for the default model) or fp32",
    )
    p.add_argument("--out", type=Path, default=None, help="also write the JSON line here")
    return p


def measure_local(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """A stack of its own; the floor built first and measured before and after it."""
    corpus = write_corpus(args.data, tmp / "corpus.jsonl", args.docs)
    precision = ("--query-precision", args.query_precision)
    run_dir = args.run_dir or tmp / "run"
    queries = load_queries(args.queries)[:300]
    print(f"\n== the floor (one thread, no RPC; {args.query_precision} queries)", flush=True)
    with tempfile.TemporaryDirectory(prefix="gtr-report-floor-") as floor_dir:
        floor = floor_bench.build_floor(corpus, Path(floor_dir), SHARDS, args.query_precision)
        first = floor_modes(floor, queries, "before the stack")
        with local_stack(run_dir, args.startup_timeout, corpus, precision) as st:
            out = measure(st, args, corpus)
        if not args.no_baseline:  # the same run dir: a restart, no first run
            before = (*precision, "--query-encoder", "triton")
            with local_stack(run_dir, args.startup_timeout, corpus, before) as st:
                out["baseline_triton_queries"] = measure_baseline(st, args)
        # after the stack stopped: the floor runs alone again, on the same documents
        print("\n== the floor again", flush=True)
        steal, t0 = cpu_roles.machine_steal_s(), time.monotonic()
        last = floor_modes(floor, queries, "after the stack")
        out["floor_steal_cores"] = (cpu_roles.machine_steal_s() - steal) / (time.monotonic() - t0)
    out["floor"] = floor_summary(first, last)
    out["floor_drift"] = last["hybrid"]["cpu_ms_per_search"] / first["hybrid"]["cpu_ms_per_search"]
    out["query_precision"] = args.query_precision
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    queries_path = args.queries or args.data / "queries.jsonl"
    args.queries = queries_path
    with tempfile.TemporaryDirectory(prefix="gtr-load-report-") as tmp_name:
        tmp = Path(tmp_name)
        if args.stack_json is not None:
            out = measure(args.stack_json, args, None)
        else:
            out = measure_local(args, tmp)
    add_ratios(out)
    out["command"] = "python -m loadtest.stack_report " + " ".join(argv or sys.argv[1:])
    print("\n== report")
    for line in summary_lines(out):
        print(line)
    line = json.dumps(out, default=lambda v: None if v != v else v)
    if args.out is not None:
        args.out.write_text(line + "\n", encoding="utf-8")
    print(line)
    return out


if __name__ == "__main__":
    from services.stack.children import sigterm_as_interrupt

    with sigterm_as_interrupt():  # SIGTERM (a `timeout`) stops the stack it started too
        main()
