"""The drift scenario of issue #24, measured: a quantizer trained on other documents, then
``index rollout --retrain``, against a stack trained on the right ones from the start.

1. ``gtr-retrieval up`` on the default corpus (the Python standard library docs): the
   IVF-PQ index is trained on them.
2. SciFact (5,183 abstracts) is upserted through the gateway without retraining, and
   evaluated: ``gtr-retrieval eval --gateway`` on SciFact's train split (``before``).
3. ``gtr-retrieval index rollout --retrain`` (same encoder, same shard count: the vectors
   the shards hold, the quantizer trained on a sample of them), then the same eval
   (``after``).
4. A second stack, ``up --corpus scifact`` (trained on SciFact from the start), the same
   eval (``reference``); it runs beside stack A unless ``--sequential`` (the two share
   nothing: their own run directories, ports and Redis).

Prints each eval's nDCG@10 (dense through the gateway, the quantizer's whole effect;
the gateway's default hybrid beside it) and, last, one JSON line with ``after -
reference`` (goal: within 0.005) and the shards' quantizer drift (``pq_error_ratio``)
before and after. ``bench/results/drift.json`` keeps it; docs/generations.md
"Measured" quotes it.

Usage: ``python -m bench.drift [--data ../shared/data/scifact] [--keep DIR]``. Takes
about 10-20 minutes on 2 cores (each stack encodes its corpus through Triton).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

SHARED = Path(
    os.environ.get("GTR_DATA_DIR", Path(__file__).resolve().parents[2] / "shared" / "data")
)


def _eval(stack: Any, data: Path, ingest: bool, log: Path) -> dict[str, Any]:
    args = [
        "eval",
        "--data",
        str(data),
        "--split",
        "train",
        "--gateway",
        stack.gateway,
        "--quiet",
        *([] if ingest else ["--no-ingest"]),
    ]
    done = stack.run_cli(*args, timeout=7200, log=log)
    if done.returncode != 0:
        raise SystemExit(f"eval failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr}")
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


def _ndcg(report: dict[str, Any]) -> dict[str, float]:
    table = report["ndcg_at_10"]
    return {k: float(table[k]) for k in ("service_dense", "service_default") if k in table}


def _drift(stack: Any) -> list[float]:
    """Each replica's pq_error_ratio (its Stats) of the serving generation."""
    import grpc

    from retrieval.v1 import index_pb2, index_pb2_grpc
    from services.generations.registry import Registry

    reg = Registry(stack.redis())
    spec = reg.addresses(reg.alias().serving) or ";".join(
        ",".join(r) for r in stack.state()["shards"]
    )
    out = []
    for shard in spec.split(";"):
        for address in filter(None, shard.split(",")):
            with grpc.insecure_channel(address) as channel:
                stats = index_pb2_grpc.IndexShardServiceStub(channel).Stats(
                    index_pb2.ShardStatsRequest(), timeout=10
                )
            out.append(round(float(stats.pq_error_ratio), 3))
    return out


def drifted(root: Path, data: Path) -> dict[str, Any]:
    """Stack A: trained on the stdlib docs, SciFact upserted, evaluated; ``index rollout
    --retrain``; evaluated again."""
    from tests.support.local_stack import local_stack

    out: dict[str, Any] = {}
    log = root / "cli-stdlib.log"
    print("stack A: up on the stdlib docs (trained on them)", flush=True)
    with local_stack(root / "run-stdlib", root / "up-stdlib.log", corpus=None) as a:
        out["before"] = _ndcg(_eval(a, data, True, log))
        out["drift_before"] = _drift(a)
        print(
            f"  A: SciFact upserted, no retraining: nDCG@10 {out['before']}, "
            f"pq_error_ratio {out['drift_before']}",
            flush=True,
        )
        t = time.monotonic()
        done = a.run_cli(
            "index",
            "rollout",
            "--retrain",
            "--run-dir",
            str(root / "run-stdlib"),
            "--yes",
            timeout=7200,
            log=log,
        )
        if done.returncode != 0:
            raise SystemExit(f"rollout --retrain failed:\n{done.stdout}\n{done.stderr}")
        out["rollout_seconds"] = round(time.monotonic() - t, 1)
        out["after"] = _ndcg(_eval(a, data, False, log))
        out["drift_after"] = _drift(a)
        print(
            f"  A: after index rollout --retrain ({out['rollout_seconds']} s): "
            f"nDCG@10 {out['after']}, pq_error_ratio {out['drift_after']}",
            flush=True,
        )
    return out


def reference(root: Path, data: Path) -> dict[str, Any]:
    """Stack B: trained on SciFact from the start, evaluated."""
    from tests.support.local_stack import local_stack

    print("stack B: up on SciFact (trained on it from the start)", flush=True)
    corpus = data / "corpus.jsonl"
    with local_stack(root / "run-scifact", root / "up-scifact.log", corpus=corpus) as b:
        out = {
            "reference": _ndcg(_eval(b, data, False, root / "cli-scifact.log")),
            "drift_reference": _drift(b),
        }
    print(f"  B: nDCG@10 {out['reference']}, pq_error_ratio {out['drift_reference']}", flush=True)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--data", type=Path, default=SHARED / "scifact", help="BEIR folder")
    parser.add_argument("--keep", type=Path, help="keep run dirs and logs here")
    parser.add_argument("--out", type=Path, default=Path("bench/results/drift.json"))
    parser.add_argument(
        "--sequential",
        action="store_true",
        help="run stack B after stack A (default: both at once; they share nothing)",
    )
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="gtr-bench-drift-") as tmp_name:
        root = args.keep or Path(tmp_name)
        root.mkdir(parents=True, exist_ok=True)
        result: dict[str, Any] = {"data": str(args.data), "split": "train"}
        start = time.monotonic()
        if args.sequential:
            result |= drifted(root, args.data)
            result |= reference(root, args.data)
        else:  # two independent stacks: their waits overlap
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(2) as pool:
                a = pool.submit(drifted, root, args.data)
                b = pool.submit(reference, root, args.data)
                result |= a.result() | b.result()

    result["after_minus_reference"] = {
        k: round(result["after"][k] - result["reference"][k], 4) for k in result["reference"]
    }
    result["before_minus_reference"] = {
        k: round(result["before"][k] - result["reference"][k], 4) for k in result["reference"]
    }
    result["within_0_005"] = abs(result["after_minus_reference"]["service_dense"]) <= 0.005
    result["seconds"] = round(time.monotonic() - start, 1)
    gap = result["after_minus_reference"]["service_dense"]
    print(f"after - reference (dense nDCG@10): {gap:+.4f} (goal: within 0.005)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    args.out.write_text(
        json.dumps({"source": {"bench": "drift", "run": stamp}, **result}, indent=2) + "\n"
    )
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
