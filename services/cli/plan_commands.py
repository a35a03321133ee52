"""``gtr-retrieval plan``: what a deployment needs, with the arithmetic shown."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from services.cli.common import config_from_args

DESCRIPTION = """\
Capacity plan from corpus size, query rate, encoder size, latency SLO, rerank depth and
replicas: shards, replicas per shard, GPUs, CPU cores and memory. Every figure prints
its formula with the numbers put in and where they came from: the benches' measured
JSON in bench/results/ (index_service.json, encoder.json, rerank_depths.json; rerun a
bench to refresh them) and the encoder size profiles (services/encoder/profiles.py).
Then the model-size vs annotated-data trade-off of "Scaling Laws for Dense Retrieval"
(Fang et al., SIGIR 2024) per encoder size (quality columns with --scaling-fit).
The last line printed is JSON.
"""


def add_cli(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        help="Capacity plan (shards, replicas, GPUs, cores, memory).",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--docs", type=int, required=True, help="Documents in the corpus.")
    p.add_argument("--qps", type=float, required=True, help="Searches per second to serve.")
    p.add_argument("--model", default="base", help="Encoder size: base, large, xl, xxl, minilm.")
    p.add_argument("--slo-ms", type=float, default=100.0, help="Search latency target (100).")
    p.add_argument("--rerank-depth", type=int, default=0, help="Candidates reranked (0: none).")
    p.add_argument("--replicas", type=int, default=2, help="Minimum replicas per shard (2).")
    p.add_argument(
        "--utilisation", type=float, default=0.5, help="Planned busy share of each core/GPU (0.5)."
    )
    p.add_argument(
        "--shard-memory-gib",
        type=float,
        default=32.0,
        help="Index memory one replica may use (32).",
    )
    p.add_argument(
        "--overhead-ms",
        type=float,
        default=10.0,
        help="Gateway, Redis fetch and network per search (10).",
    )
    p.add_argument("--doc-bytes", type=int, default=2000, help="Stored bytes per document.")
    p.add_argument("--results", type=Path, default=None, help="bench/results folder to read.")
    p.add_argument(
        "--scaling-fit",
        type=Path,
        default=None,
        help="JSON {A, alpha, B, beta, delta, source} of the joint scaling law.",
    )
    p.add_argument(
        "--annotations",
        type=float,
        default=None,
        help="Annotated training queries D for the scaling-law columns.",
    )
    p.add_argument(
        "--gpu-shards",
        action="store_true",
        help="Shards search on GPUs (index.gpu.enabled): count a GPU per shard replica, "
        "twice that during a rollout.",
    )
    p.add_argument(
        "--encoder-arch",
        default="sde",
        choices=["sde", "ade", "ade-ste", "ade-fte", "ade-spl"],
        help="Architecture of a checkpoint of `encoder train` (sde): the asymmetric ones "
        "hold two towers per Triton instance (weights ~2x, same compute per text).",
    )
    p.set_defaults(handler=run)


def _num(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 or float(value).is_integer() else f"{value:,.2f}"


def run(args: argparse.Namespace) -> int:
    from services.common.errors import RetrievalError
    from services.plan import measured
    from services.plan.capacity import PlanInput, plan
    from services.plan.scaling import ScalingFit, size_table

    try:
        m = measured.load(args.results or measured.RESULTS)
        inp = config_from_args(PlanInput, args, min_replicas=args.replicas)
        result = plan(inp, m)
        fit = ScalingFit.read(args.scaling_fit) if args.scaling_fit else None
        rows = size_table(fit, args.annotations)
    except RetrievalError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    print(
        f"plan: {inp.docs:,} documents, {inp.qps:g} searches/s, encoder {inp.model}, SLO "
        f"{inp.slo_ms:g} ms, rerank depth {inp.rerank_depth}\n"
    )
    for line in result.lines:
        print(f"  {line.name:<36} {_num(line.value):>10} {line.unit:<5}  = {line.formula}")
        for source in line.sources:
            print(f"  {'':<36} {'':>10} {'':<5}    from {source}")
    for warning in result.warnings:
        print(f"\n  warning: {warning}")
    print("\nmodel size vs annotated data (Fang et al., SIGIR 2024), per encoder size:")
    print(
        f"  {'size':<7} {'params':>7} {'dim':>4} {'latency':>8} {'serving cost':>12} "
        f"{'L(N, D)':>8} {'D for base L':>13}"
    )
    for r in rows:
        ent = f"{r.entropy:.3f}" if r.entropy is not None else "—"
        need = _num(r.annotations_to_match) if r.annotations_to_match is not None else "—"
        print(
            f"  {r.size:<7} {r.params_millions:>6}M {r.dim:>4} {r.latency_ms:>6.0f}ms "
            f"{r.relative_serving_cost:>11.2f}× {ent:>8} {need:>13}"
        )
    if fit is None or args.annotations is None:
        print(
            "  L(N, D) and D columns need --scaling-fit and --annotations: the paper's "
            "constants are fitted per dataset and annotation kind (see docs/performance.md)"
        )
    else:
        print(f"  fit: {fit.source}; D = {args.annotations:,.0f} annotated queries")
    _print_towers()
    print(
        json.dumps(
            {
                "input": asdict(inp),
                "plan": {line.name: round(line.value, 3) for line in result.lines},
                "warnings": result.warnings,
                "sizes": [asdict(r) for r in rows],
            }
        )
    )
    return 0


def _print_towers() -> None:
    from services.plan.towers import ARCHS, tower_table

    print(
        "\nencoder weights per Triton instance by `encoder train --arch` (compute per text "
        "unchanged; services/plan/towers.py):"
    )
    print(f"  {'size':<7} " + " ".join(f"{a:>16}" for a in ARCHS))
    tables = {a: tower_table(a) for a in ARCHS}
    for i, row in enumerate(tables["sde"]):
        cells = []
        for a in ARCHS:
            r = tables[a][i]
            gib = r.cpu_gib_per_instance if r.size == "minilm" else r.gpu_gib_per_instance
            cells.append(f"{gib:>6.2f} GiB {r.vs_sde:>4.2f}×")
        where = "CPU, FP32" if row.size == "minilm" else "GPU, FP16"
        print(f"  {row.size:<7} " + " ".join(f"{c:>16}" for c in cells) + f"   ({where})")
