"""Sweep mode: step the offered rate up until the SLO breaks, then narrow the edge.

Each step is an open-loop run of ``step_s`` seconds at one rate (rates grow by
``factor``). A step meets the SLO when its p99 is within the budget *and* at least 99 %
of its scheduled requests succeeded within it; the first step that does not ends the
climb (when already the first rate breaks it, the rates step down by ``factor`` until one
meets it), and ``refine`` more steps bisect (geometrically) between the last good and
the first bad rate. With ``criterion="throughput"`` a step is good when the server kept
up with it (achieved rate within 10 % of the scheduled one, at most 1 % errors), whatever
its latency: that finds the knee of the curve when no rate meets the SLO. A step where
the generator itself fell behind stops the sweep with ``stop_reason: generator``: past
that point the figures would describe the generator. The result's ``best_rate`` is the
highest offered rate that met the SLO (either criterion), ``max_kept_up_rate`` the
highest one the server kept up with, and :func:`plot` draws latency percentiles and
attainment against offered rate as a PNG.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from loadtest.processes import run_in_processes
from loadtest.results import ATTAINMENT_GOAL, PERCENTILES, summarize
from loadtest.runner import RunConfig
from loadtest.target import Target
from loadtest.workload import Workload


@dataclass(frozen=True)
class SweepConfig:
    start_rate: float
    slo_ms: float
    factor: float = 1.5
    max_rate: float = 10_000.0
    min_rate: float = 0.01  # stepping down (the first rate already breaks it) stops here
    step_s: float = 10.0
    max_steps: int = 16
    refine: int = 2  # bisection steps between the last good and the first bad rate
    cooldown_s: float = 1.0  # idle time between steps, so a backlog does not carry over
    lag_limit_ms: float | None = None  # None: results.LAG_LIMIT_SHARE of the budget
    # What a step must keep to count as good: the SLO, or (to find the knee when no rate
    # meets the SLO) that it is kept up with: the achieved rate within 10 % of the
    # scheduled one and at most 1 % errors.
    criterion: Literal["slo", "throughput"] = "slo"

    def __post_init__(self) -> None:
        if self.start_rate <= 0 or self.factor <= 1.0 or self.step_s <= 0:
            raise ValueError("sweep needs start rate > 0, factor > 1 and step seconds > 0")


async def sweep(
    target: Target,
    workload: Workload,
    run: RunConfig,
    cfg: SweepConfig,
    on_step: Callable[[dict[str, Any]], None] = lambda s: None,
) -> dict[str, Any]:
    """Run the steps; the result holds every step's summary and the best rate."""
    steps: list[dict[str, Any]] = []
    good: float | None = None
    bad: float | None = None
    reason = "max_steps"

    async def step(rate: float) -> dict[str, Any]:
        if steps and cfg.cooldown_s > 0:
            await asyncio.sleep(cfg.cooldown_s)
        step_run = replace(run, rate=rate, duration_s=cfg.step_s, seed=run.seed + len(steps))
        summary = summarize(
            await run_in_processes(target, workload, step_run, step_run.processes),
            cfg.slo_ms,
            cfg.lag_limit_ms,
        )
        steps.append(summary)
        on_step(summary)
        return summary

    def passed(summary: dict[str, Any]) -> bool:
        return bool(summary["slo_met"]) if cfg.criterion == "slo" else keeps_up(summary)

    rate = cfg.start_rate
    while len(steps) < cfg.max_steps:
        if rate > cfg.max_rate or rate < cfg.min_rate:
            reason = "max_rate" if rate > cfg.max_rate else "min_rate"
            break
        summary = await step(rate)
        if summary["generator_behind"]:
            reason = "generator"
            break
        if passed(summary):
            good = rate
            if bad is not None:  # came down to a rate that meets it: the edge is found
                reason = cfg.criterion
                break
            rate *= cfg.factor
        else:
            bad = rate
            if good is not None:
                reason = cfg.criterion
                break
            rate /= cfg.factor  # not even the first rate meets it: step down
    for _ in range(cfg.refine if reason == cfg.criterion and good is not None else 0):  # the edge
        assert good is not None and bad is not None
        mid = math.sqrt(good * bad)
        summary = await step(mid)
        if summary["generator_behind"]:
            break
        if passed(summary):
            good = mid
        else:
            bad = mid
    kept = [s["offered_rate"] for s in steps if keeps_up(s) and not s["generator_behind"]]
    best = max(
        (s for s in steps if s["slo_met"] and not s["generator_behind"]),
        key=lambda s: s["offered_rate"],
        default=None,
    )
    return {
        "slo_ms": cfg.slo_ms,
        "attainment_goal": ATTAINMENT_GOAL,
        "stop_reason": reason,
        "best_rate": best["offered_rate"] if best else None,
        "best_achieved_rate": best["achieved_rate"] if best else None,
        "best_p99_ms": best["p99_ms"] if best else None,
        "best_attainment": best["slo_attainment"] if best else None,
        "first_failing_rate": bad,
        "criterion": cfg.criterion,
        "max_kept_up_rate": max(kept, default=None),
        "steps": steps,
    }


def keeps_up(step: dict[str, Any]) -> bool:
    """The server kept up with the step's rate (whatever the latency)."""
    # Against the realised arrival rate, not the nominal one: a short Poisson step
    # schedules ± its square root of requests.
    scheduled = step["scheduled_rate"]
    return bool(
        scheduled == scheduled  # NaN: a single request
        and step["achieved_rate"] >= 0.9 * scheduled
        and step["error_fraction"] <= 0.01
    )


def plot(result: dict[str, Any], path: Path, title: str) -> Path:
    """Latency percentiles (log scale) and SLO attainment against offered rate, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sorted(result["steps"], key=lambda s: s["offered_rate"])
    rates = [s["offered_rate"] for s in steps]
    fig, (top, bottom) = plt.subplots(
        2, 1, sharex=True, figsize=(7.5, 6.5), gridspec_kw={"height_ratios": [3, 2]}
    )
    for name in PERCENTILES:
        top.plot(rates, [s[f"{name}_ms"] for s in steps], marker="o", label=name.replace("_", "."))
    top.axhline(result["slo_ms"], color="red", linestyle="--", label=f"SLO {result['slo_ms']:g} ms")
    if result["best_rate"] is not None:
        for ax in (top, bottom):
            ax.axvline(result["best_rate"], color="green", linestyle=":")
    behind = [s for s in steps if s["generator_behind"]]
    if behind:  # its latencies include the generator's own lag: say so on the plot
        kw = {"marker": "x", "color": "grey", "linestyle": "none", "markersize": 10}
        top.plot(
            [s["offered_rate"] for s in behind],
            [s["p99_ms"] for s in behind],
            label="generator behind (p99)",
            **kw,
        )
        bottom.plot(
            [s["offered_rate"] for s in behind], [s["slo_attainment"] * 100 for s in behind], **kw
        )
    top.set_yscale("log")
    top.set_ylabel("latency from scheduled send (ms)")
    top.legend(fontsize="small")
    top.grid(True, which="both", alpha=0.3)
    top.set_title(title, fontsize="medium")
    bottom.plot(rates, [s["slo_attainment"] * 100 for s in steps], marker="o", color="black")
    bottom.axhline(
        result["attainment_goal"] * 100,
        color="red",
        linestyle="--",
        label=f"goal {result['attainment_goal']:.0%}",
    )
    bottom.set_ylabel(f"within {result['slo_ms']:g} ms (%)")
    bottom.set_xlabel("offered rate (requests/s, open loop)")
    bottom.set_ylim(min(90.0, min(s["slo_attainment"] * 100 for s in steps) - 2), 100.5)
    bottom.legend(fontsize="small")
    bottom.grid(True, alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
