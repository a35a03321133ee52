"""A shard replica's start, forked from the stack's fork server against exec'd (issue #33).

    .venv/bin/python -m bench.shard_start [--docs 500] [--restarts 4]

Two local stacks one after the other on the same corpus (SciFact's first ``--docs``
documents, 2 shards x 1 replica): ``up`` as shipped (shard processes forked from the fork
server, services/stack/forking.py) and ``up --no-fork-shards`` (each a fresh
interpreter). In each, every shard replica is killed with SIGKILL ``--restarts`` times in
turn and the supervisor restarts it; per restart the bench reads:

- **cpu_s**: the CPU time (user + system, every thread) the new process had used when
  ``stack.json`` first listed it running, i.e. its start: imports (exec'd only), the
  index loaded, its log replayed, its gRPC server up;
- **ready_s**: from the new process's start (``/proc/<pid>/stat``) to that moment (the
  supervisor's readiness probe polls every 0.2 s and this bench every 0.05 s).

Prints the medians of each mode and their ratios, forked over exec'd, measured in the
same run; one JSON line last (``--out``, default ``bench/results/shard_start.json``). Run
it alone: a restart's CPU and wall time are the machine's.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.output import save
from bench.rollout import SCIFACT
from services.process import cpus as cpu_sets


def _child(stack: Any, name: str) -> dict[str, Any]:
    return next(c for c in stack.state()["children"] if c["name"] == name)


def _restart(stack: Any, name: str) -> dict[str, float]:
    """Kill ``name`` with SIGKILL; once its new process is listed running: its CPU time
    and its start-to-running seconds."""
    old = _child(stack, name)["pid"]
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            child = _child(stack, name)
        except (OSError, ValueError, StopIteration):
            child = {}
        pid = child.get("pid")
        if pid and pid != old and child.get("state") == "running":
            seen = time.monotonic()
            cpu, began = cpu_sets.cpu_seconds(pid), cpu_sets.started_s(pid)
            if cpu is not None and began is not None:
                return {"cpu_s": cpu, "ready_s": seen - began}
        time.sleep(0.05)
    raise SystemExit(f"{name} was not running again within 120 s:\n{stack.tail()}")


def _mode(corpus: Path, tmp: Path, restarts: int, fork: bool) -> list[dict[str, float]]:
    from tests.support.local_stack import local_stack

    extra = ["--max-restarts", str(4 * restarts + 4), "--restart-window", "3600"]
    if not fork:
        extra.append("--no-fork-shards")
    label = "forked" if fork else "execd"
    samples = []
    with local_stack(
        tmp / f"run-{label}", tmp / f"up-{label}.log", corpus=corpus, extra=extra
    ) as stack:
        names = [c["name"] for c in stack.state()["children"] if c["name"].startswith("shard-")]
        for _ in range(restarts):
            for name in names:
                samples.append(_restart(stack, name))
                time.sleep(1.0)  # the restarted replica settles before the next kill
    return samples


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--docs", type=int, default=500, help="SciFact documents stored (500)")
    parser.add_argument("--restarts", type=int, default=4, help="kills per shard replica (4)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/shard_start.json"))
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from tests.support.local_stack import small_corpus

    with tempfile.TemporaryDirectory(prefix="gtr-bench-shard-start-") as name:
        tmp = Path(name)
        corpus = tmp / "corpus.jsonl"
        small_corpus(SCIFACT, corpus, args.docs, 1000)
        modes = {
            "forked": _mode(corpus, tmp, args.restarts, fork=True),
            "execd": _mode(corpus, tmp, args.restarts, fork=False),
        }
    medians = {
        mode: {k: round(statistics.median(s[k] for s in samples), 3) for k in ("cpu_s", "ready_s")}
        for mode, samples in modes.items()
    }
    result: dict[str, Any] = {
        "source": {
            "bench": "shard_start",
            "run": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        },
        "docs": args.docs,
        "restarts": {mode: len(samples) for mode, samples in modes.items()},
        "median": medians,
        "samples": {
            mode: [{k: round(v, 3) for k, v in s.items()} for s in samples]
            for mode, samples in modes.items()
        },
        "cpu_forked_over_execd": round(medians["forked"]["cpu_s"] / medians["execd"]["cpu_s"], 3),
        "ready_forked_over_execd": round(
            medians["forked"]["ready_s"] / medians["execd"]["ready_s"], 3
        ),
    }
    for mode, m in medians.items():
        print(
            f"{mode}: a restarted shard replica used {m['cpu_s']:.3f} s of CPU and was running "
            f"{m['ready_s']:.2f} s after its start (medians of {len(modes[mode])})"
        )
    print(
        f"forked over exec'd: CPU {result['cpu_forked_over_execd']}x, start to running "
        f"{result['ready_forked_over_execd']}x"
    )
    save(args.out, result)
    return result


if __name__ == "__main__":
    main()
