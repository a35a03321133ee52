"""End to end against its bottleneck: gateway Search throughput ÷ Triton encode-only
throughput, the same queries at the same concurrency, measured in one run.

    python -m loadtest.bottleneck --stack-json /tmp/c-run/stack.json [--concurrency 16]
    python -m loadtest.bottleneck --target HOST:PORT --triton HOST:PORT

When the encoder is the bottleneck, a gateway that adds little gets close to what
Triton alone embeds: the goal is ``ratio`` ≥ 0.8. Both sides are closed loops of
``--concurrency`` callers (Search with k=``--k`` through the gateway; one-query
``embed`` calls straight to Triton with ``services.encoder.runtime.triton_client``), run in
``--rounds`` alternating slices so drift on a shared machine hits both, and the medians
compared.

Placement (``--placement``). ``split`` gives Triton cores of its own (``--encoder-cpus``,
default the upper half) and the gateway, the shards, Redis, Prometheus and this load
generator the rest, as a deployment with Triton on its own node does: the ratio then
says whether the gateway keeps the encoder busy. ``shared`` leaves every process on
every core: on a small machine the search path's own CPU (gateway, shards, Redis) is
then taken from the encoder's, and the ratio measures CPU per search instead. With a
stack.json whose processes run on this machine the default is ``both`` (``ratio`` is the
split one), else ``shared``. With a stack.json, the CPU each of its processes (and this
generator) spent per search and per encode is reported too (``cpu_ms_per_search``,
``cpu_ms_per_encode``, from /proc): where a search's CPU goes. Prints a line per round,
then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from loadtest import placement
from loadtest.closedloop import ClosedLoopResult, closed_loop
from loadtest.results import json_line
from loadtest.target import (
    DEFAULT_ADDRESS,
    Target,
    add_target_arguments,
    target_from_args,
    target_from_stack,
)
from loadtest.workload import load_queries
from retrieval.v1 import search_pb2, search_pb2_grpc
from services.rpc.tls import ClientTLS


class CpuMeter:
    """CPU seconds each named process (descendants included) spends in the slices run
    under :meth:`slice`, per kind of slice."""

    def __init__(self, processes: Mapping[str, int]) -> None:
        self.processes = dict(processes)
        self.spent: dict[str, dict[str, float]] = {}

    def _cpu(self, name: str) -> float:
        # The generator alone: when it started the stack (stack_report), the stack is
        # its descendants and is counted under its own names.
        return placement.cpu_seconds(self.processes[name], descendants=name != GENERATOR)

    @contextmanager
    def slice(self, kind: str) -> Iterator[None]:
        before = {name: self._cpu(name) for name in self.processes}
        yield
        spent = self.spent.setdefault(kind, dict.fromkeys(self.processes, 0.0))
        for name in self.processes:
            spent[name] += max(0.0, self._cpu(name) - before[name])

    def per_call_ms(self, kind: str, calls: int) -> dict[str, float]:
        """Milliseconds of CPU per completed call, by process, largest first."""
        spent = self.spent.get(kind, {})
        per = {name: 1000.0 * s / calls for name, s in spent.items()} if calls else {}
        return dict(sorted(per.items(), key=lambda item: -item[1]))


async def measure(
    target: Target,
    triton_url: str,
    queries: list[str],
    args: argparse.Namespace,
    processes: Mapping[str, int] | None = None,
    triton_tls: ClientTLS | None = None,
) -> dict[str, Any]:
    """``processes`` (name → pid, on this machine): their CPU per search and per encode
    is reported too. ``triton_tls``: how to reach a Triton that wants (m)TLS."""
    from services.encoder.runtime.triton_client import TritonEncoder, TritonEncoderConfig

    meter = CpuMeter(processes or {})
    requests = [search_pb2.SearchRequest(query=q, k=args.k) for q in queries]
    encoder = await TritonEncoder.connect(TritonEncoderConfig(triton_url, tls=triton_tls))
    channel = target.aio_channel()
    try:
        stub = search_pb2_grpc.SearchServiceStub(channel)
        metadata = target.metadata or None

        def search(i: int) -> Any:
            return stub.Search(requests[i % len(requests)], timeout=args.timeout, metadata=metadata)

        def encode(i: int) -> Any:
            return encoder.encode([queries[i % len(queries)]], "query", timeout=args.timeout)

        for call in (search, encode):  # warm-up: connections, Triton's first batches
            await closed_loop(call, args.concurrency, min(2.0, args.seconds))
        gw: list[ClosedLoopResult] = []
        tr: list[ClosedLoopResult] = []
        for r in range(args.rounds):
            with meter.slice("search"):
                gw.append(await closed_loop(search, args.concurrency, args.seconds))
            with meter.slice("encode"):
                tr.append(await closed_loop(encode, args.concurrency, args.seconds))
            print(
                f"round {r + 1}: gateway {gw[-1].throughput:7.1f} searches/s "
                f"(p50 {gw[-1].percentile_ms(50):.1f} ms, errors "
                f"{gw[-1].errors or '-'}), triton "
                f"{tr[-1].throughput:7.1f} encodes/s (p50 {tr[-1].percentile_ms(50):.1f} ms)",
                flush=True,
            )
    finally:
        await channel.close()
        await encoder.close()
    for kind, results in (("search", gw), ("encode", tr)):
        per = meter.per_call_ms(kind, sum(r.codes["OK"] for r in results))
        if per:
            shown = ", ".join(f"{name} {ms:.2f}" for name, ms in per.items() if ms >= 0.01)
            print(f"CPU ms per {kind}: {shown}", flush=True)
    gateway_rate = statistics.median(r.throughput for r in gw)
    triton_rate = statistics.median(r.throughput for r in tr)
    ratios = [g.throughput / t.throughput for g, t in zip(gw, tr, strict=True) if t.throughput]
    return {
        "gateway_searches_per_s": gateway_rate,
        "triton_encodes_per_s": triton_rate,
        "ratio": gateway_rate / triton_rate if triton_rate else None,
        "rounds_ratio_min": min(ratios, default=None),
        "rounds_ratio_max": max(ratios, default=None),
        "gateway_p50_ms": statistics.median(r.percentile_ms(50) for r in gw),
        "triton_p50_ms": statistics.median(r.percentile_ms(50) for r in tr),
        "gateway_errors": sum((sum(r.codes.values()) - r.codes["OK"] for r in gw), 0),
        "cpu_ms_per_search": meter.per_call_ms("search", sum(r.codes["OK"] for r in gw)),
        "cpu_ms_per_encode": meter.per_call_ms("encode", sum(r.codes["OK"] for r in tr)),
    }


ENCODER_CHILDREN = ("triton",)  # the stack.json children that serve the encoder
GENERATOR = "generator"  # this process, in the CPU accounting


def measure_placements(
    target: Target,
    triton_url: str,
    queries: list[str],
    args: argparse.Namespace,
    stack: dict[str, Any] | None,
) -> dict[str, Any]:
    """:func:`measure` once per placement of ``args.placement`` (None: ``both`` when the
    stack's processes run here and there are two CPUs, else ``shared``)."""
    children = placement.stack_children(stack or {})
    encoder_pids = [pid for name, pid in children.items() if name in ENCODER_CHILDREN]
    other_pids = [pid for name, pid in children.items() if name not in ENCODER_CHILDREN]
    tls = (stack or {}).get("internal_tls") or {}  # `up --tls`: Triton wants mTLS
    triton_tls = ClientTLS(tls["ca"], tls["cert"], tls["key"]) if tls else None
    processes = children | {GENERATOR: os.getpid()}
    split: placement.Split | None = None
    chosen = args.placement
    if chosen != "shared":
        try:
            if not encoder_pids:
                raise ValueError(
                    "a split placement pins the processes of a local stack: give the "
                    "--stack-json of a `gtr-retrieval up` running on this machine"
                )
            split = placement.split_cpus(placement.usable_cpus(), args.encoder_cpus)
        except ValueError as exc:
            if chosen is not None:
                raise SystemExit(f"error: --placement {chosen}: {exc}") from None
            print(f"placement: shared only ({exc})", flush=True)
    names = ["shared"] if split is None else ["split"] if chosen == "split" else ["shared", "split"]
    out: dict[str, Any] = {"concurrency": args.concurrency, "goal": 0.8}
    for name in names:
        if name == "shared":
            print("== shared: every process on every core", flush=True)
            out["shared"] = asyncio.run(
                measure(target, triton_url, queries, args, processes, triton_tls)
            )
            continue
        assert split is not None
        print(
            f"== split: Triton on CPUs {sorted(split.encoder)}, the gateway, shards, Redis "
            f"and this generator on CPUs {sorted(split.stack)}",
            flush=True,
        )
        groups = {split.encoder: encoder_pids, split.stack: other_pids}
        # This process alone, not its descendants: stack_report starts the stack it
        # measures, so Triton is one of them.
        with (
            placement.pinned(groups),
            placement.pinned({split.stack: [os.getpid()]}, descendants=False),
        ):
            result = asyncio.run(measure(target, triton_url, queries, args, processes, triton_tls))
        out["split"] = result | {
            "encoder_cpus": sorted(split.encoder),
            "stack_cpus": sorted(split.stack),
        }
    out["placement"] = names[-1]
    out["ratio"] = out[names[-1]]["ratio"]
    return out


def endpoints(args: argparse.Namespace) -> tuple[Target, str, dict[str, Any] | None]:
    target = target_from_args(args)
    triton = args.triton
    stack = None
    if args.stack_json is not None:
        stack = json.loads(Path(args.stack_json).read_text(encoding="utf-8"))
        if args.address == DEFAULT_ADDRESS:  # no --target given: the stack's gateway
            target = target_from_stack(stack, token=target.token)
        triton = triton or stack["triton_grpc"]
    if not triton:
        raise SystemExit("error: --triton HOST:PORT or --stack-json is needed")
    return target, triton, stack


def _cpus(text: str) -> frozenset[int]:
    try:
        return placement.parse_cpus(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.bottleneck", description=(__doc__ or "").split("\n\n")[0]
    )
    add_target_arguments(p)
    p.add_argument("--triton", default=None, help="Triton gRPC host:port")
    p.add_argument(
        "--stack-json",
        type=Path,
        default=None,
        help="stack.json of `gtr-retrieval up` (gateway and Triton addresses; its process "
        "ids for --placement split)",
    )
    p.add_argument(
        "--placement",
        choices=("shared", "split", "both"),
        default=None,
        help="shared: every process on every core; split: Triton on --encoder-cpus, the "
        "rest of the stack and this generator on the other CPUs (needs --stack-json of a "
        "stack on this machine); both (the default when that is given, else shared)",
    )
    p.add_argument(
        "--encoder-cpus",
        type=_cpus,
        default=None,
        help="CPUs for Triton in the split placement, e.g. 1 or 4-7 (default: the upper "
        "half of this process's CPUs)",
    )
    p.add_argument("--concurrency", type=int, default=16, help="callers on each side (16)")
    p.add_argument("--seconds", type=float, default=5.0, help="per round and side (5)")
    p.add_argument("--rounds", type=int, default=3, help="alternations (3)")
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--timeout", type=float, default=10.0, help="deadline per call (10 s)")
    p.add_argument("--queries", type=Path, default=None, help="BEIR queries.jsonl")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    target, triton, stack = endpoints(args)
    out = measure_placements(target, triton, load_queries(args.queries), args, stack)
    print(json_line(out))
    return out


if __name__ == "__main__":
    main()
