"""Two Triton servers behind one gateway's encoder: how the encodes are shared.

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.triton_balance [--seconds 15] [--concurrency 8]

Two real ``tritonserver`` processes serve the default model's CPU repository on one gRPC
port at 127.0.0.2 and 127.0.0.3, and a real DNS server resolves ``triton.bench`` to both,
as the chart's headless Service resolves to the Triton pods. One ``TritonEncoder`` (what
the gateway builds from ``--triton-url``) is given the name and driven by
``--concurrency`` closed-loop callers (one query each call) for ``--seconds``:

* ``min_triton_share``: the share of the encodes that the less used server answered,
  counted by each Triton itself (``nv_inference_request_success`` on its metrics
  endpoint), with the encoder balancing over the addresses the name resolves to
  (least outstanding first; 0.5 = even);
* ``baseline_min_triton_share``: the same load through the former wiring, one gRPC
  channel to the same ``dns:`` name (gRPC's resolver, pick_first), measured in the same
  run;
* ``round_robin_min_triton_share``: the same load with ``--balance round_robin``
  (strictly in turn, whatever each server's speed). Least outstanding gives the server
  that answers faster more, so its share follows what each server gets of the shared
  cores; in turn shows the split without that;
* ``failed`` / ``baseline_failed``: encodes of each run that failed; ``encodes_per_s`` /
  ``baseline_encodes_per_s``: throughput (both servers share the machine's cores with
  the client, so this says little about scaling).

One JSON line last.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from loadtest.closedloop import closed_loop
from loadtest.results import json_line
from loadtest.workload import load_queries

HOSTS = ("127.0.0.2", "127.0.0.3")
NAME = "triton.bench"


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


async def _run(
    target: str, queries: list[str], args: argparse.Namespace, mode: str
) -> dict[str, Any]:
    from services.encoder.runtime.triton_client import (
        TritonEncoder,
        TritonEncoderConfig,
        TritonServer,
    )
    from services.rpc.balance import Balancing
    from services.rpc.discovery import parse_dns_target

    balancing = Balancing("round_robin" if mode == "round_robin" else "least_outstanding")
    cfg = TritonEncoderConfig(target, retries=0, balancing=balancing)
    encoder = await TritonEncoder.connect(cfg)
    if mode == "former":  # one channel to the dns: name: gRPC's resolver, pick_first (bench only)
        pool = encoder.pool
        await pool.close()
        pool.endpoints = [TritonServer(str(parse_dns_target(target)), cfg, None)]
        pool.target = None
    try:
        for q in queries[:16]:  # warm-up: connections, the model's first batches
            await encoder.encode([q], "query", timeout=30)
        result = await closed_loop(
            lambda i: encoder.encode([queries[i % len(queries)]], "query", timeout=30),
            args.concurrency,
            args.seconds,
        )
    finally:
        await encoder.close()
    return {
        "ok": result.codes["OK"],
        "failed": sum(n for code, n in result.codes.items() if code != "OK"),
        "encodes_per_s": result.throughput,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        prog="python -m bench.triton_balance", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--seconds", type=float, default=15.0, help="each run's length (15 s)")
    parser.add_argument("--concurrency", type=int, default=8, help="closed-loop callers (8)")
    parser.add_argument("--queries", type=Path, default=None, help="BEIR queries.jsonl")
    parser.add_argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help="leave both servers on every core (default: each on a core of its own)",
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from loadtest.placement import pinned, usable_cpus
    from services.encoder.build.export import export_onnx
    from services.encoder.build.repository import RepositoryConfig, generate_repository
    from services.encoder.model import default_model_dir
    from services.encoder.serve.triton_server import TritonServerConfig, run_triton
    from tests.support.dns import run_dns
    from tests.support.processes import free_port, wait_for_port
    from tests.support.triton import inferences

    queries = load_queries(args.queries)
    out: dict[str, Any] = {"seconds": args.seconds, "concurrency": args.concurrency}
    with tempfile.TemporaryDirectory(prefix="gtr-bench-triton-balance-") as tmp:
        onnx_path = Path(tmp) / "model.onnx"
        export_onnx(default_model_dir(), onnx_path)
        repo = Path(tmp) / "repo"
        generate_repository(onnx_path, repo, RepositoryConfig())
        port = free_port()
        configs = [
            TritonServerConfig(
                repo, grpc_port=port, http_port=free_port(), metrics_port=free_port(), host=host
            )
            for host in HOSTS
        ]
        with (
            run_dns() as dns,
            run_triton(configs[0], Path(tmp) / "a.log") as a,
            run_triton(configs[1], Path(tmp) / "b.log") as b,
        ):
            for handle in (a, b):  # the metrics endpoint may come after the model is ready
                wait_for_port(handle.config.metrics_port, 30, handle.config.host)
            dns.set(NAME, list(HOSTS))
            target = dns.target(NAME, port)
            cpus = sorted(usable_cpus())
            pin = args.pin and len(cpus) >= 2
            out["pinned"] = pin
            # one core per server (as one pod per node), the client on all of them
            groups = {frozenset({cpus[0]}): [a.process.pid], frozenset({cpus[-1]}): [b.process.pid]}
            with pinned(groups) if pin else contextlib.nullcontext():
                for key, mode in (
                    ("baseline_", "former"),
                    ("", "balanced"),
                    ("round_robin_", "round_robin"),
                ):
                    before = [inferences(a), inferences(b)]
                    run = asyncio.run(_run(target, queries, args, mode))
                    counts = [inferences(a) - before[0], inferences(b) - before[1]]
                    share = min(counts) / max(1, sum(counts))
                    out[f"{key}min_triton_share"] = share
                    out[f"{key}counts"] = counts
                    out[f"{key}failed"] = run["failed"]
                    out[f"{key}encodes_per_s"] = run["encodes_per_s"]
                    label = {
                        "former": "one channel (former)",
                        "balanced": "least outstanding",
                        "round_robin": "round robin",
                    }[mode]
                    say(
                        f"{label:>22}: encodes per Triton {counts} (by their metrics), "
                        f"min share {share:.3f}, {run['failed']} failed, "
                        f"{run['encodes_per_s']:.0f} encodes/s"
                    )
    print(json_line(out))
    return out


if __name__ == "__main__":
    main()
