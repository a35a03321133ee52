"""``index rollout --retrain`` under writes, several rollouts pooled (issue #33).

    .venv/bin/python -m bench.rollout_rounds [--rounds 8] [--docs 500] [--writes-per-s 21]

A retrain rollout of ``bench.rollout``'s 500 documents takes ~4 s, so one run's "during"
window holds ~80 searches: its p99 is their second-slowest, and its 95 % interval spanned
0.92-1.68 (2026-12-01). This bench rolls out ``--rounds`` retrains in one stack, one after
the other under the same load as ``bench.rollout`` (searches at 20/s, writes at
``--writes-per-s``), and pools their searches:

- **before**: the ``--before-s`` seconds before the first rollout, as ``bench.rollout``;
- **during**: every search that started while one of the rollouts ran (its CLI, from
  start to exit);
- between two rounds, outside both windows, the generation the last rollout displaced is
  retired (``index retire``, as an operator keeps one rollback target), and the stack is
  left ``--gap-s`` seconds to settle;
- **between**: the searches of those settling gaps (after the retire, before the next
  round), a control interleaved with the rounds. The store grows by a quarter of the
  write rate and the rounds run minutes after the window before, so ``during`` over
  ``between`` is the rollout's own cost with that drift taken out (printed beside the
  issue's ratio, during over before, not instead of it).

Where in a round the latency goes: ``p99_by_segment_ms`` pools every round's searches per
segment (:data:`SEGMENTS`: the CLI's start, the train phase, the catch-up until the
target's shards published their addresses, the catch-up after, the switch), each with its
p99, its count and ``slow``: how many took over 1.5x the p99 before (the pooled p99 is over
1.5x when more than 1 % of all searches are), with ``slow_stages_ms``: the mean of those
slow searches' gateway stages and ``outside`` the gateway's handler, against
``stages_before_ms`` (every search before), and ``slow_on_target``: how many of them the
round's new generation answered (in the switch: its first searches) and
``slow_from_switch_ms``, when each began from the first search the target answered
(``slow_wall_s``: on the wall clock, to lay over a probe's timeline).
``failures``: each failed search's status, detail, round and phase. ``redis_over_1ms``:
what Redis's SLOWLOG caught over 1 ms during the rounds and outside them
(:mod:`bench.redis_stalls`: a command running holds every other client). ``cores``: the
cores each process role used (:mod:`bench.cpu_roles`, sampled every half second; the
rounds' generations named ``shards source``/``shards target``), the machine's busy cores
and the hypervisor's ``steal``, in the window before, the gaps between and each segment:
a slow hour of this VM and a change's own cost told apart; ``machine_speed_ms``: the
machine's own pace before the load and after it (:mod:`bench.machine_speed`). ``--up-log``
keeps the stack's output (its CPU placement lines).

Each round's acknowledged writes after its P0 are checked in its new generation, as
``bench.rollout`` checks them (``bench/rollout_writes.py``: the source's logs are held
until its round is checked). Prints per round its length, searches, p99 and the writes
checked and lost, then the pooled ratio with its 95 % block-bootstrap interval
(``bench/p99_interval.py``); one JSON line last (``--out``, default
``bench/results/rollout_retrain_rounds.json``). The rollouts get the last CPU as their
budget, as ``bench.rollout``'s. Run it alone.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from bench import cpu_roles, machine_speed, redis_stalls
from bench.output import save
from bench.p99_interval import p99_ratio_interval
from bench.rollout import (
    PhaseWatch,
    add_stack_arguments,
    loaded_stack,
    p99,
    rollout_budget,
    under_load,
)
from bench.rollout_writes import check_writes, hold_source
from services.process import cpus as cpu_sets


def _round(stack: Any, cli_budget: list[str], run_dir: Path, log: Path) -> dict[str, Any]:
    """One retrain rollout, its source's logs held for the write check: its start, end,
    the names and P0 the watcher saw."""
    held = stack.redis()
    try:
        hold_source(held)
    finally:
        held.close()
    with PhaseWatch(stack.redis_url) as watch:
        start, wall_start = time.monotonic(), time.time()
        done = stack.run_cli(
            "index",
            "rollout",
            "--retrain",
            "--run-dir",
            str(run_dir),
            "--yes",
            *cli_budget,
            timeout=1800,
            log=log,
        )
    end, wall_end = time.monotonic(), time.time()
    if done.returncode != 0:
        raise SystemExit(f"index rollout failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return {
        "start": start,
        "end": end,
        "wall": (wall_start, wall_end),
        "names": watch.names,
        "p0_at": watch.seen.get("train"),
        "seen": watch.seen,
    }


# The segments of a retrain rollout, each from its mark to the next one seen: the CLI
# starting (imports, the lock, P0), the export and the training, the catch-up until the
# target's shards published their addresses (their start), the catch-up after, the switch.
SEGMENTS = ("start", "train", "catch_up", "published", "switch")
CPU_EVERY_S = 0.5  # the role sampler's interval (~3.5 ms of CPU a sample here)


def by_segment(searches: list[Any], rounds: list[dict[str, Any]], slow_s: float) -> dict[str, Any]:
    """The OK searches of every round pooled per segment (:data:`SEGMENTS`): their p99
    (ms), count, how many took over ``slow_s`` (1.5x the p99 before: the pooled p99 is
    over it when more than 1 % of all did) and the segment's mean length (s): where in a
    rollout the latency goes."""
    pooled: dict[str, list[Any]] = {name: [] for name in SEGMENTS}
    lengths: dict[str, list[float]] = {name: [] for name in SEGMENTS}
    targets: dict[int, str] = {}  # id(search) → its round's target
    switched: dict[int, float] = {}  # id(search) → when its round's target answered first
    walls: dict[int, float] = {}  # id(search) → its start, wall clock (UNIX s)
    firsts = {  # id(round) → when its target answered first
        id(one): min(
            (
                s.start
                for s in searches
                if s.generation == one["names"].get("target") and s.start >= one["start"]
            ),
            default=one["end"],
        )
        for one in rounds
    }
    for name, windows in segment_windows(rounds).items():
        for begin, stop, one in windows:
            target, first = one["names"].get("target"), firsts[id(one)]
            lengths[name].append(stop - begin)
            mine = [s for s in searches if begin <= s.start < stop and s.code == "OK"]
            pooled[name] += mine
            targets.update((id(s), target) for s in mine)
            switched.update((id(s), first) for s in mine)
            walls.update((id(s), one["wall"][0] + s.start - one["start"]) for s in mine)
    out: dict[str, Any] = {}
    for name in SEGMENTS:
        latencies = [s.latency for s in pooled[name]]
        slow = [s for s in pooled[name] if s.latency > slow_s]
        out[name] = {
            "p99_ms": round(1e3 * p99(latencies), 1) if latencies else None,
            "searches": len(latencies),
            "slow": len(slow),
            "slow_stages_ms": mean_stages(slow),
            # answered by the round's target (the new generation's first searches, in the
            # switch), not by the generation that served before
            "slow_on_target": sum(s.generation == targets[id(s)] for s in slow),
            # each slow search's start from the first search its round's target answered
            # (the gateway's switch; negative: before it)
            "slow_from_switch_ms": sorted(round(1e3 * (s.start - switched[id(s)])) for s in slow),
            # ... and on the wall clock (UNIX s), to lay over a probe's timeline
            "slow_wall_s": sorted(round(walls[id(s)], 3) for s in slow),
            "mean_s": round(float(np.mean(lengths[name])), 2) if lengths[name] else None,
        }
    return out


def _generic(role: str, names: dict[str, str]) -> str:
    """A round's role named across rounds: its source's and target's shards as such."""
    for kind in ("source", "target"):
        if names.get(kind) and role == f"shards {names[kind]}":
            return f"shards {kind}"
    return "shards other" if role.startswith("shards ") else role


def pooled_cores(windows: list[tuple[float, float, Any]], samples: list[Any]) -> Any:
    """Cores by role over ``windows`` (start, end, the round or None) pooled:
    CPU seconds summed over them ÷ their summed length; roles under 0.02 of a core left
    out. None without samples over them."""
    used: dict[str, float] = {}
    length = 0.0
    for start, end, one in windows:
        names = one["names"] if one else {}
        got = cpu_roles.seconds_used(samples, start, end)
        if got:
            length += end - start
            for role, seconds in got.items():
                key = _generic(role, names)
                used[key] = used.get(key, 0.0) + seconds
    if not length:
        return None
    cores = cpu_roles.with_other({k: v / length for k, v in used.items()})
    return {k: round(v, 2) for k, v in sorted(cores.items(), key=lambda kv: -kv[1]) if v >= 0.02}


def segment_windows(rounds: list[dict[str, Any]]) -> dict[str, list[tuple[float, float, Any]]]:
    """Each segment's (start, end, round) in every round (:data:`SEGMENTS`)."""
    out: dict[str, list[tuple[float, float, Any]]] = {name: [] for name in SEGMENTS}
    for one in rounds:
        marks = sorted(
            [(one["start"], "start")]
            + [(t, k) for k, t in one["seen"].items() if k in SEGMENTS and k != "start"]
        )
        for n, (begin, name) in enumerate(marks):
            stop = marks[n + 1][0] if n + 1 < len(marks) else one["end"]
            out[name].append((begin, stop, one))
    return out


def failure(search: Any, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """A failed search as the JSON keeps it: status, detail, its round (0-based) and the
    rollout phase seen last before it began ("start" before any)."""
    for n, one in enumerate(rounds):
        if one["start"] <= search.start < one["end"]:
            seen = [(t, k) for k, t in one["seen"].items() if t <= search.start]
            phase = max(seen)[1] if seen else "start"
            return {"code": search.code, "detail": search.detail[:200], "round": n, "phase": phase}
    return {"code": search.code, "detail": search.detail[:200], "round": None, "phase": None}


STAGES = ("encode", "search", "fetch", "total")


def mean_stages(searches: list[Any]) -> dict[str, float] | None:
    """The mean of ``searches``' gateway stages (ms) and ``outside``: client latency less
    the gateway's total (the transport, the load generator, a gateway loop busy before the
    handler began); None without a timed search."""
    timed = [s for s in searches if s.stages]
    if not timed:
        return None
    out = {k: round(float(np.mean([s.stages[k] for s in timed])), 1) for k in STAGES}
    out["outside"] = round(float(np.mean([1e3 * s.latency - s.stages["total"] for s in timed])), 1)
    return out


def _check(stack: Any, writes: list[Any], one: dict[str, Any]) -> None:
    """The round's acknowledged writes after its P0, checked in its new generation
    before the next round retires its source (and its logs)."""
    client = stack.redis()
    try:
        names = one["names"]
        after = one["p0_at"] or one["start"]
        check = check_writes(client, list(writes), names["source"], names["target"], after)
    finally:
        client.close()
    one["writes_checked"], one["lost"] = check.checked, check.lost


def _retire(stack: Any, run_dir: Path, log: Path) -> None:
    done = stack.run_cli("index", "retire", "--run-dir", str(run_dir), "--yes", log=log)
    if done.returncode != 0:
        raise SystemExit(f"index retire failed ({done.returncode}):\n{done.stdout}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=8, help="retrain rollouts (8)")
    add_stack_arguments(parser, docs=500, writes_per_s=21.0)
    parser.add_argument("--gap-s", type=float, default=10.0, help="settling between rounds")
    parser.add_argument("--up-log", type=Path, help="keep the stack's output (`up`) here")
    parser.add_argument(
        "--up-arg",
        action="append",
        default=[],
        help="one more flag for `up` (repeatable; e.g. --up-arg=--no-fork-shards)",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("bench/results/rollout_retrain_rounds.json")
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    budget = rollout_budget(args.cpus, cpu_sets.available())
    cli_budget = ["--cpus", cpu_sets.format_cpus(budget)] if budget else []
    rounds: list[dict[str, Any]] = []
    gaps: list[tuple[float, float]] = []  # the settling windows between rounds
    stacked = loaded_stack(args, budget, "gtr-bench-rounds-", args.up_arg, args.up_log)
    with (
        stacked as (stack, load, tmp, run_dir),
        cpu_roles.RoleCpu(
            os.getpid(), every_s=CPU_EVERY_S, stack_file=run_dir / "stack.json"
        ) as cpu,
    ):
        client = stack.redis()
        slowlog = redis_stalls.start(client)

        async def run_rounds() -> None:
            for i in range(args.rounds):
                if i:
                    await asyncio.to_thread(_retire, stack, run_dir, tmp / "retire.log")
                    settled = time.monotonic()
                    await asyncio.sleep(args.gap_s)
                    gaps.append((settled, time.monotonic()))
                log = tmp / f"rollout-{i}.log"
                one = await asyncio.to_thread(_round, stack, cli_budget, run_dir, log)
                await asyncio.sleep(1.0)  # the last acknowledgements of the source
                await asyncio.to_thread(_check, stack, load.record.writes, one)
                rounds.append(one)
                print(f"round {i + 1}: {one['end'] - one['start']:.1f} s", flush=True)
            await asyncio.sleep(3.0)  # writes to the last generation, then stop

        speed = {"before": machine_speed.speed_ms()}  # the stack up, no load yet
        first = under_load(load, args.before_s, run_rounds)
        speed["after"] = machine_speed.speed_ms()  # the load stopped
        stalls = redis_stalls.summary(
            redis_stalls.collect(client, slowlog), [r["wall"] for r in rounds]
        )
        client.close()

    searches = load.record.searches
    before = [s for s in searches if first - args.before_s <= s.start < first and s.code == "OK"]
    during: list[Any] = []
    per_round = []
    for one in rounds:
        mine = [s for s in searches if one["start"] <= s.start < one["end"]]
        during += mine
        ok = [s.latency for s in mine if s.code == "OK"]
        per_round.append(
            {
                "seconds": round(one["end"] - one["start"], 2),
                "generation": one["names"].get("target"),
                "searches": len(mine),
                "failed": len(mine) - len(ok),
                "p99_ms": round(1e3 * p99(ok), 1) if ok else None,
                "writes_checked": one["writes_checked"],
                "lost_writes": len(one["lost"]),
            }
        )
    ok_during = [s for s in during if s.code == "OK"]
    between = [s for s in searches if s.code == "OK" and any(a <= s.start < b for a, b in gaps)]
    p99_before = 1e3 * p99([s.latency for s in before])
    p99_during = 1e3 * p99([s.latency for s in ok_during])
    p99_between = 1e3 * p99([s.latency for s in between]) if between else None
    interval = p99_ratio_interval(
        ([s.start for s in before], [s.latency for s in before]),
        ([s.start for s in ok_during], [s.latency for s in ok_during]),
    )
    between_interval = (
        p99_ratio_interval(
            ([s.start for s in between], [s.latency for s in between]),
            ([s.start for s in ok_during], [s.latency for s in ok_during]),
        )
        if between
        else None
    )
    acked = [
        w
        for w in load.record.writes
        if w.ok and any(r["start"] <= w.start < r["end"] for r in rounds)
    ]
    seconds = sum(r["end"] - r["start"] for r in rounds)
    result: dict[str, Any] = {
        "source": {
            "bench": "rollout_rounds",
            "run": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        },
        "docs": args.docs,
        "rounds": per_round,
        "rollout_seconds": round(seconds, 2),
        "searches_before": len(before),
        "searches_during": len(during),
        "failed_during": len(during) - len(ok_during),
        # each failed search: its status, detail, round and the phase it began in
        "failures": [failure(s, rounds) for s in during if s.code != "OK"],
        "p50_before_ms": round(1e3 * float(np.median([s.latency for s in before])), 2),
        "p50_during_ms": round(1e3 * float(np.median([s.latency for s in ok_during])), 2),
        "p99_before_ms": round(p99_before, 2),
        "p99_during_ms": round(p99_during, 2),
        "p99_during_over_before": round(p99_during / p99_before, 3),
        "p99_during_over_before_ci95": [round(v, 3) for v in interval] if interval else None,
        "searches_between": len(between),
        "p99_between_ms": round(p99_between, 2) if p99_between else None,
        "p99_during_over_between": round(p99_during / p99_between, 3) if p99_between else None,
        "p99_during_over_between_ci95": (
            [round(v, 3) for v in between_interval] if between_interval else None
        ),
        "writes_per_s": round(len(acked) / seconds, 2) if seconds else None,
        "writes_checked": sum(r["writes_checked"] for r in per_round),
        "lost_writes": sum(r["lost_writes"] for r in per_round),
        "cpu_budget": cpu_sets.format_cpus(budget) if budget else "none",
        "p99_by_segment_ms": by_segment(searches, rounds, 1.5e-3 * p99_before),
        "stages_before_ms": mean_stages(before),
        "redis_over_1ms": stalls,
        # the machine's own pace before the load and after it (bench/machine_speed.py, ms
        # for a fixed piece of work; lower is faster): which period of this VM a run is from
        "machine_speed_ms": speed,
        # cores by role (the machine's busy ones and the hypervisor's steal too) in the
        # window before, the gaps between and each segment of the rounds pooled: an hour
        # of this VM's and a change's own cost told apart
        "cores": {
            "before": pooled_cores([(first - args.before_s, first, None)], cpu.samples),
            "between": pooled_cores([(a, b, None) for a, b in gaps], cpu.samples),
            **{
                name: pooled_cores(windows, cpu.samples)
                for name, windows in segment_windows(rounds).items()
            },
        },
    }
    for r in per_round:
        print(
            f"{r['generation']}: {r['seconds']} s, {r['searches']} searches "
            f"({r['failed']} failed), p99 {r['p99_ms']} ms; writes checked "
            f"{r['writes_checked']}, lost {r['lost_writes']}"
        )
    print(
        f"search p99: {p99_before:.1f} ms before ({len(before)} searches), {p99_during:.1f} ms "
        f"during {len(rounds)} retrain rollouts ({len(during)} searches, "
        f"{result['failed_during']} failed): {result['p99_during_over_before']}x "
        f"(goal <= 1.5; 95 % interval {result['p99_during_over_before_ci95']}); "
        f"{result['lost_writes']} of {result['writes_checked']} acknowledged writes lost"
    )
    if p99_between:
        print(
            f"  between the rounds (the settling gaps, {len(between)} searches): p99 "
            f"{p99_between:.1f} ms; during over between {result['p99_during_over_between']}x "
            f"(95 % interval {result['p99_during_over_between_ci95']})"
        )
    for name, seg in result["p99_by_segment_ms"].items():
        print(
            f"  {name}: p99 {seg['p99_ms']} ms over {seg['searches']} searches "
            f"({seg['slow']} over 1.5x the p99 before, {seg['slow_on_target']} of them on the "
            f"target, their stages {seg['slow_stages_ms']}), "
            f"{seg['mean_s']} s"
        )
    print(f"  machine speed (ms for a fixed piece of work, lower is faster): {speed}")
    for name, used in result["cores"].items():
        print(f"  cores {name}: {used}")
    failed = Counter((f["code"], f["phase"]) for f in result["failures"])
    if failed:
        print(f"  failed searches by status and phase: {dict(failed)}")
    print(f"  stages before (mean of every search): {result['stages_before_ms']}")
    for name, part in stalls.items():
        print(
            f"  Redis commands over 1 ms {name} the rounds: {part['commands']}, "
            f"{part['total_ms']} ms in all, the longest {part['longest_ms']} ms; "
            f"most: {part['by_command_ms']}"
        )
    save(args.out, result)
    return result


if __name__ == "__main__":
    main()
