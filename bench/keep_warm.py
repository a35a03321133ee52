"""Does an idle-class spinner on each CPU shorten the stack's searches? (issue #34)

    .venv/bin/python -m bench.keep_warm [--rates 40,80,120] [--seconds 20] [--rounds 2]

``bench.neighbor`` found the int8 query graph's p99 *halved* (p50 -7 %) with a
SCHED_IDLE process encoding on the same CPU: the vCPU never idles, so the search's work
never pays for waking it (this VM's guest has no halt-polling cpuidle driver: an idle
vCPU halts and the hypervisor deschedules it; docs/performance.md "Where a quiet search's
time goes" measured the same cold core at 1.24-1.68x). This bench asks whether that
holds for the whole stack: ``gtr-retrieval up`` on 1,500 SciFact documents (2 shards,
the default hybrid search), Poisson hybrid searches at each of ``--rates`` for
``--seconds``, with and without one SCHED_IDLE spinning process pinned to each CPU
(:class:`KeepWarm`: it runs only when its CPU has nothing else to run, and dies with
this bench), alternated by round (the order reversed every other
round). Per rate: p50, p99 and the share within the SLO, each with / without (median of
the rounds' ratios, with their range). One JSON line (``--out``, default
``bench/results/keep_warm.json``). Run it alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import floor as floor_bench

CHANNELS = 8
FIGURES = ("p50_ms", "p99_ms", "slo_attainment", "achieved_rate")

# what each spinner runs: pin, become idle-class, die with the parent, spin
_SPINNER = """
import ctypes, os, signal, sys
cpu = int(sys.argv[1])
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[2]):
    sys.exit(0)  # the parent died before the line above took effect
os.sched_setaffinity(0, {cpu})
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
print("ready", flush=True)
while True:
    pass
"""


@dataclass
class KeepWarm:
    """The spinners started by :meth:`start`; :meth:`stop` ends them."""

    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @classmethod
    def start(cls, cpus: set[int] | None = None) -> KeepWarm:
        """One spinner per CPU of ``cpus`` (default: this process's affinity set), each
        running once this returns."""
        warm = cls()
        try:
            for cpu in sorted(cpus if cpus is not None else os.sched_getaffinity(0)):
                proc = subprocess.Popen(
                    [sys.executable, "-S", "-c", _SPINNER, str(cpu), str(os.getpid())],
                    stdout=subprocess.PIPE,
                    stdin=subprocess.DEVNULL,
                )
                warm.procs.append(proc)
                assert proc.stdout is not None
                if proc.stdout.readline().strip() != b"ready":
                    raise RuntimeError(f"the spinner of CPU {cpu} did not start")
        except BaseException:
            warm.stop()
            raise
        return warm

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        self.procs.clear()


def one_rate(address: str, rate: float, seconds: float, seed: int) -> dict[str, Any]:
    from loadtest.budget import default_slo_ms
    from loadtest.processes import run_in_processes
    from loadtest.results import summarize
    from loadtest.runner import RunConfig
    from loadtest.target import Target
    from loadtest.workload import Workload, load_queries

    workload = Workload(queries=load_queries(None), mode="hybrid")
    run = RunConfig(rate=rate, duration_s=seconds, seed=seed, channels=CHANNELS)
    records = asyncio.run(run_in_processes(Target(address=address), workload, run, 1))
    summary = summarize(records, default_slo_ms("minilm"))
    return {k: summary[k] for k in FIGURES}


def measure(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from tests.support.local_stack import local_stack, small_corpus

    corpus = tmp / "corpus.jsonl"
    small_corpus(floor_bench.SCIFACT, corpus, args.docs, text_chars=100_000)
    rates = [float(r) for r in args.rates.split(",")]
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        f"{r:g}": {"off": [], "on": []} for r in rates
    }
    with local_stack(tmp / "run", tmp / "up.log", corpus=corpus, shards=2) as stack:
        one_rate(stack.gateway, rates[0], 15.0, 99)  # warm-up, not recorded
        for rnd in range(args.rounds):
            order = ("off", "on") if rnd % 2 == 0 else ("on", "off")
            for rate in rates:
                for mode in order:
                    warm = KeepWarm.start() if mode == "on" else None
                    try:
                        row = one_rate(stack.gateway, rate, args.seconds, seed=rnd)
                    finally:
                        if warm is not None:
                            warm.stop()
                    runs[f"{rate:g}"][mode].append(row)
                    print(
                        f"round {rnd + 1} rate {rate:g}/s spinners {mode}: "
                        f"p50 {row['p50_ms']:.1f} ms p99 {row['p99_ms']:.1f} ms "
                        f"within {row['slo_attainment']:.4f}",
                        flush=True,
                    )
    return {"rates": {rate: _ratios(pair) for rate, pair in runs.items()}, "runs": runs}


def _ratios(pair: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for figure in ("p50_ms", "p99_ms"):
        ratios = [on[figure] / off[figure] for on, off in zip(pair["on"], pair["off"], strict=True)]
        out[f"{figure}_on_over_off"] = {
            "median": round(statistics.median(ratios), 3),
            "min": round(min(ratios), 3),
            "max": round(max(ratios), 3),
        }
        for mode in ("off", "on"):
            out[f"{figure}_{mode}"] = round(statistics.median(r[figure] for r in pair[mode]), 2)
    for mode in ("off", "on"):
        out[f"within_slo_{mode}"] = round(min(r["slo_attainment"] for r in pair[mode]), 4)
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.keep_warm", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--rates", default="40,80,120", help="offered hybrid searches/s")
    parser.add_argument("--seconds", type=float, default=20.0, help="per rate and mode")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--docs", type=int, default=1500)
    parser.add_argument("--out", type=Path, default=Path("bench/results/keep_warm.json"))
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    load_before = [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="gtr-bench-keep-warm-") as tmp:
        out = measure(args, Path(tmp))
    out["loadavg_before"] = load_before
    out["measured_at"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    for rate, row in out["rates"].items():
        print(
            f"{rate}/s: p50 {row['p50_ms_off']} -> {row['p50_ms_on']} ms "
            f"(x{row['p50_ms_on_over_off']['median']}), p99 {row['p99_ms_off']} -> "
            f"{row['p99_ms_on']} ms (x{row['p99_ms_on_over_off']['median']}), within SLO "
            f"{row['within_slo_off']} -> {row['within_slo_on']}",
            flush=True,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out) + "\n")
    return out


if __name__ == "__main__":
    main()
