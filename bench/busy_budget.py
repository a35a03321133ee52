"""The rollout benches' control: the budget's CPU kept busy by plain work, yielding and at
full weight, in one stack (docs/generations.md "A rollout yields the CPUs",
docs/performance.md "Searches before document encodes").

    .venv/bin/python -m bench.busy_budget [--rounds 8] [--busy-s 5] [--kinds none,one,yielding]

The same stack and load as ``bench.rollout_rounds`` (500 SciFact documents, searches at
``--searches-per-s``, writes at 21/s, the client off the budget's CPU), but no rollout:
``--rounds`` windows of ``--busy-s`` seconds, ``--gap-s`` apart, each of the next of
``--kinds`` in turn:

- **none**: nothing busy, the baseline within the run (the stack's own drift over it);
- **one**: nothing busy, every thread of the stack pinned off the budget's CPU: serving
  without that CPU at all;
- **yielding**, **short**, **idle**, **full**: a process of its own session, pinned to the
  budget's CPU (the last), works on one thread (``--work``: ``matmul``, a 512 x 384 float32
  matrix by its transpose, a training step's kind of work; ``spin``, the interpreter's
  loop alone; ``--duty`` below 1 works ``--slice-ms`` then leaves the CPU idle for the
  rest of the slice's share, as a paced rollout would). Yielding: its session's
  autogroup at nice 19, as ``index rollout --cpus`` gives the CLI and the target's
  shards; short: that and a 0.1 ms scheduler slice (``bench/sched_slice.py``); idle: that
  and the ``SCHED_IDLE`` policy; full: nice 0.

It pools the searches of each kind against the ``--before-s`` seconds before the first
window and prints each kind's p99, its ratio to the p99 before with a 95 % block-bootstrap
interval (``bench/p99_interval.py``), the CPU seconds the busy process got, the writes'
p99, and what the stack's threads (``up`` and its descendants) got from the scheduler
(``/proc/<pid>/task/<tid>/schedstat``): CPU and time runnable but waiting for a CPU, per
search. ``--triton-nice`` is ``up``'s (0 to compare with its default 10);
``--stack-slice-us`` gives every thread of the stack a scheduler slice. What it separates:
a rollout's p99 during ÷ before that a busy CPU explains (this bench's ratio) from what the
rollout's other work adds (Redis, the serving replicas' export, a new process's start),
and where the busy CPU's cost goes. One JSON line last (``--out``, default
``bench/results/busy_budget.json``). Run it alone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import sched_slice
from bench.output import save
from bench.p99_interval import p99_ratio_interval
from bench.rollout import add_stack_arguments, loaded_stack, p99, rollout_budget, under_load
from services.process import cpus as cpu_sets
from services.process import priority

# a slice of work (``--slice-ms``), then a pause that leaves the CPU idle for the rest of
# the slice's share (``--duty``): a paced rollout's kind of load
LOOP = (
    "import sys, time\n"
    "{setup}"
    "end = time.monotonic() + float(sys.argv[1])\n"
    "work_s, duty = float(sys.argv[2]) / 1e3, float(sys.argv[3])\n"
    "while time.monotonic() < end:\n"
    "    stop = time.monotonic() + work_s\n"
    "    while time.monotonic() < stop:\n"
    "        {step}\n"
    "    if duty < 1:\n"
    "        time.sleep(work_s * (1 / duty - 1))\n"
)
WORK = {
    # a training step's kind of work: float32 matrix products, ~1.5 MB touched
    "matmul": LOOP.format(
        setup="import numpy as np\na = np.random.default_rng(0).random((512, 384), "
        "dtype=np.float32)\n",
        step="a @ a.T",
    ),
    # the interpreter's loop alone: next to no memory traffic
    "spin": LOOP.format(setup="", step="pass"),
}
# how the busy process runs: its session at nice 19 (as a rollout yields), that and the
# SCHED_IDLE policy (a CPU running only such tasks counts as idle where a woken thread is
# placed), or at full weight; or no busy process at all (the within-run baseline: the
# stack's own drift over the run, the store growing with the writes, shows there)
KINDS = ("none", "one", "yielding", "short", "idle", "full")


def _stack_tids(root: int) -> list[int]:
    """Every thread of ``root`` and its descendants."""
    out: list[int] = []
    todo = [root]
    while todo:
        pid = todo.pop()
        todo.extend(cpu_sets.children_of(pid))
        with contextlib.suppress(OSError):
            out.extend(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    return out


def _serving_sched(root: int) -> tuple[float, float, int]:
    """What the stack's threads (:func:`_stack_tids`; the busy process is not one) got
    from the scheduler so far, summed (``/proc/<tid>/schedstat``): (CPU seconds, seconds
    waited runnable on a run queue, times run)."""
    cpu = wait = runs = 0
    for tid in _stack_tids(root):
        try:
            with open(f"/proc/{tid}/schedstat") as fh:
                ran, waited, slices = (int(v) for v in fh.read().split())
        except (OSError, ValueError):
            continue  # the thread ended
        cpu, wait, runs = cpu + ran, wait + waited, runs + slices
    return cpu / 1e9, wait / 1e9, runs


def _busy(
    args: argparse.Namespace, cpus: frozenset[int], kind: str, root: int
) -> tuple[float, float]:
    """One busy window: (its start, the CPU seconds the busy process got)."""
    if kind in ("none", "one"):
        rest = cpu_sets.machine() - cpus
        tids = _stack_tids(root) if kind == "one" else []
        for tid in tids:  # the stack without the budget's CPU, nothing on it
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, rest)
        start = time.monotonic()
        time.sleep(args.busy_s)
        for tid in _stack_tids(root) if kind == "one" else []:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, cpu_sets.machine())
        return start, 0.0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            WORK[args.work],
            str(args.busy_s),
            str(args.slice_ms),
            str(args.duty),
        ],
        env=env,
        start_new_session=True,
    )
    cpu_sets.pin_process(proc.pid, cpus)
    if kind == "idle":
        os.sched_setscheduler(proc.pid, os.SCHED_IDLE, os.sched_param(0))
    if kind == "short":
        sched_slice.set_slice(proc.pid, sched_slice.SHORT_SLICE_NS)
    if kind in ("yielding", "short", "idle"):
        deadline = time.monotonic() + 2
        while priority.set_group_nice(proc.pid, priority.YIELD_NICE) is None:
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)
    start = time.monotonic()
    used = 0.0
    while proc.poll() is None:
        used = cpu_sets.cpu_seconds(proc.pid) or used
        time.sleep(0.1)
    return start, used


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=8, help="busy windows, alternating (8)")
    parser.add_argument("--busy-s", type=float, default=5.0, help="each window (5 s)")
    parser.add_argument("--gap-s", type=float, default=5.0, help="between windows (5 s)")
    parser.add_argument(
        "--work",
        choices=sorted(WORK),
        default="matmul",
        help="matmul: float32 matrix products (default); spin: the interpreter's loop alone",
    )
    parser.add_argument(
        "--duty", type=float, default=1.0, help="share of each slice worked (1: always busy)"
    )
    parser.add_argument("--slice-ms", type=float, default=20.0, help="a slice of work (20 ms)")
    parser.add_argument(
        "--kinds",
        default="yielding,full",
        help="the windows' kinds, taken in turn: none (no busy process: the baseline within "
        "the run), yielding (nice 19 session), short (that and a 0.1 ms slice), idle (that "
        "and SCHED_IDLE), full (default: yielding,full)",
    )
    parser.add_argument(
        "--stack-slice-us",
        type=int,
        default=0,
        help="give every thread of the stack this scheduler slice (us; 0: the kernel's)",
    )
    add_stack_arguments(parser, docs=500, writes_per_s=21.0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/busy_budget.json"))
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not priority.autogroup_enabled():
        raise SystemExit("this kernel has no autogroup: yielding has no session weight here")

    kinds = [k for k in args.kinds.split(",") if k]
    if not kinds or set(kinds) - set(KINDS):
        parser.error(f"--kinds: a comma list of {', '.join(KINDS)}")
    budget = rollout_budget(args.cpus, cpu_sets.available())
    if budget is None:
        raise SystemExit("a busy budget CPU needs two CPUs and a budget (--cpus)")
    # kind, start, end, the busy process's CPU seconds, the stack's (CPU s, s waited, runs)
    windows: list[tuple[str, float, float, float, tuple[float, ...]]] = []
    with loaded_stack(args, budget, "gtr-bench-busy-") as (stack, load, _, _):
        if args.stack_slice_us:
            tids = _stack_tids(stack.process.pid)
            done = sum(sched_slice.set_slice(t, 1000 * args.stack_slice_us) for t in tids)
            print(f"slice {args.stack_slice_us} us: {done} of {len(tids)} threads", flush=True)

        async def run_windows() -> None:
            for i in range(args.rounds):
                kind = kinds[i % len(kinds)]
                sched = _serving_sched(stack.process.pid)
                begin, used = await asyncio.to_thread(_busy, args, budget, kind, stack.process.pid)
                got = _serving_sched(stack.process.pid)
                delta = tuple(b - a for a, b in zip(sched, got, strict=True))
                windows.append((kind, begin, time.monotonic(), used, delta))
                print(f"window {i + 1} ({kind}): {used:.2f} CPU s", flush=True)
                await asyncio.sleep(args.gap_s)

        first = under_load(load, args.before_s, run_windows)

    searches = [s for s in load.record.searches if s.code == "OK"]
    before = [s for s in searches if first - args.before_s <= s.start < first]
    p99_before = 1e3 * p99([s.latency for s in before])
    writes = [w for w in load.record.writes if w.ok]

    def write_p99(spans: list[tuple[float, float]]) -> float:
        """The p99 (ms) of the acknowledged writes that started within one of ``spans``."""
        taken = [w.end - w.start for w in writes if any(b <= w.start < e for b, e in spans)]
        return round(1e3 * p99(taken), 2)

    result: dict[str, Any] = {
        "source": {
            "bench": "busy_budget",
            "run": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        },
        "docs": args.docs,
        "searches_per_s": args.searches_per_s,
        "writes_per_s_asked": args.writes_per_s,
        "busy_s": args.busy_s,
        "work": args.work,
        "duty": args.duty,
        "slice_ms": args.slice_ms,
        "kinds": kinds,
        "cpu_budget": cpu_sets.format_cpus(budget),
        "searches_before": len(before),
        "p99_before_ms": round(p99_before, 2),
        "write_p99_before_ms": write_p99([(first - args.before_s, first)]),
    }
    for kind in kinds:
        mine = [w for w in windows if w[0] == kind]
        during = [s for s in searches if any(b <= s.start < e for _, b, e, _, _ in mine)]
        served = [sum(w[4][i] for w in mine) for i in range(3)]
        p99_during = 1e3 * p99([s.latency for s in during])
        interval = p99_ratio_interval(
            ([s.start for s in before], [s.latency for s in before]),
            ([s.start for s in during], [s.latency for s in during]),
        )
        result[kind] = {
            "windows": len(mine),
            "searches": len(during),
            "p99_ms": round(p99_during, 2),
            "p99_over_before": round(p99_during / p99_before, 3),
            "p99_over_before_ci95": [round(v, 3) for v in interval] if interval else None,
            "busy_cpu_s_per_window": round(sum(w[3] for w in mine) / max(1, len(mine)), 2),
            "write_p99_ms": write_p99([(b, e) for _, b, e, _, _ in mine]),
            # the stack's threads: CPU and run-queue wait per search, wait per time run
            "stack_cpu_ms_per_search": round(1e3 * served[0] / max(1, len(during)), 2),
            "stack_wait_ms_per_search": round(1e3 * served[1] / max(1, len(during)), 2),
            "stack_wait_us_per_run": round(1e6 * served[1] / max(1, served[2]), 1),
        }
        print(
            f"{kind}: search p99 {p99_before:.1f} ms before ({len(before)} searches), "
            f"{p99_during:.1f} ms while the budget's CPU was busy ({len(during)} searches): "
            f"{result[kind]['p99_over_before']}x (95 % interval "
            f"{result[kind]['p99_over_before_ci95']}); the busy process got "
            f"{result[kind]['busy_cpu_s_per_window']} CPU s of {args.busy_s} s per window; "
            f"the stack's threads used {result[kind]['stack_cpu_ms_per_search']} CPU ms and "
            f"waited {result[kind]['stack_wait_ms_per_search']} ms runnable per search "
            f"({result[kind]['stack_wait_us_per_run']} us per run); write p99 "
            f"{result['write_p99_before_ms']} ms before, {result[kind]['write_p99_ms']} ms"
        )
    save(args.out, result)
    return result


if __name__ == "__main__":
    main()
