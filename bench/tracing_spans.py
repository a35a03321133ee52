"""Where tracing's CPU goes, per span, in one process: the OpenTelemetry SDK's ``Tracer``
and OTLP exporter (what services/telemetry used up to commit da678e4) against
services/telemetry as it is, one change at a time, in one run.

    flock -x /tmp/gtr-bench.lock .venv/bin/python -m bench.tracing_spans [--searches 3000]

Each variant runs in a child process of its own, which makes the spans of one hybrid
search the way the gateway and its two shards make them (the same names, kinds,
attributes, nesting, W3C propagation calls and exemplar reads, in one asyncio task)
``--searches`` times at 100 % sampling, and exports them over OTLP/gRPC to a receiver in
another process (tests/support/otlp.py; its CPU is not counted). CPU = the child's user +
system time over the searches and a final flush (every thread: the SDK's export thread,
which encodes the spans, runs in the traced process), and its main thread's alone. The
variants alternate over ``--rounds``; figures are the medians.

- ``sdk``: the SDK's ``TracerProvider`` (``ParentBased(TraceIdRatioBased(1))``),
  ``BatchSpanProcessor`` and ``OTLPSpanExporter``, the spans opened as the code did
  before (``tracer.start_span`` made current with ``context.attach``), 15 spans a search
  (the gateway's ``index search`` included);
- ``sdk+encoder``: the same with services/telemetry/otlp.py's exporter;
- ``recorder-15``: services/telemetry (its recorder, services/telemetry/spans.py, and its
  exporter), still the 15 spans;
- ``recorder``: services/telemetry as the services use it: 13 spans (no ``index search``,
  and a wave of one search makes no span of its own);
- ``off``: tracing off, the hooks' no-ops.

The queue of the batch processor is made large enough (``OTEL_BSP_MAX_QUEUE_SIZE``) that
no span is dropped, so every span made is encoded and sent. A real search's CPU is
bench/tracing_overhead.py's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.index_service import say

RESULT = Path(__file__).resolve().parent / "results" / "tracing_spans.json"
ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("sdk", "sdk+encoder", "recorder-15", "recorder", "off")
SHARDS = 2


class SdkHooks:
    """The hooks as services/telemetry/tracing.py made them with the SDK's ``Tracer``
    before (commit da678e4): the same calls, for the ``sdk`` variants."""

    CLIENT: Any = None

    def __init__(self, endpoint: str, lean_encoder: bool) -> None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        from services.telemetry.otlp import SpanExporter

        exporter_type = SpanExporter if lean_encoder else OTLPSpanExporter
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": "gtr-gateway"}),
            sampler=ParentBased(TraceIdRatioBased(1.0)),
        )
        exporter = exporter_type(endpoint=endpoint, insecure=True, timeout=5)
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("gtr-retrieval")
        self.propagator = TraceContextTextMapPropagator()
        self.CLIENT = SpanKind.CLIENT
        self.SERVER = SpanKind.SERVER

    def _active(self, span: Any) -> _SdkActive:
        return _SdkActive(span)

    def span(self, name: str, kind: Any = None) -> Any:
        from opentelemetry.trace import SpanKind

        return self._active(self.tracer.start_span(name, kind=kind or SpanKind.INTERNAL))

    def server_span(self, name: str, traceparent: str, attributes: Any = None) -> Any:
        parent = self.propagator.extract({"traceparent": traceparent})
        return self._active(
            self.tracer.start_span(
                name.lstrip("/"), context=parent, kind=self.SERVER, attributes=attributes
            )
        )

    def batch_span(self, name: str, members: list[Any]) -> Any:
        from opentelemetry import trace

        parent = trace.set_span_in_context(trace.NonRecordingSpan(members[0]))
        span = self.tracer.start_span(name, context=parent, links=[])
        span.set_attribute("gtr.batch.requests", len(members))
        return self._active(span)

    def capture(self) -> Any:
        from opentelemetry import trace

        return trace.get_current_span().get_span_context()

    def traceparent(self) -> str:
        from opentelemetry import trace

        ctx = trace.get_current_span().get_span_context()
        return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"

    def exemplar(self) -> Any:
        from opentelemetry import trace

        ctx = trace.get_current_span().get_span_context()
        return {"trace_id": f"{ctx.trace_id:032x}"} if ctx.trace_flags.sampled else None

    def flush(self) -> None:
        self.provider.force_flush()

    def shutdown(self) -> None:
        self.provider.shutdown()


class _SdkActive:
    """The span made current for a ``with`` block, as the code did it before (its
    ``_Active``: ``context.attach``, then ``detach`` and ``end``)."""

    __slots__ = ("_span", "_token")

    def __init__(self, span: Any) -> None:
        self._span = span
        self._token: Any = None

    def __enter__(self) -> Any:
        from opentelemetry import context, trace

        self._token = context.attach(trace.set_span_in_context(self._span))
        return self._span

    def __exit__(self, *exc: object) -> None:
        from opentelemetry import context

        context.detach(self._token)
        self._span.end()


class OurHooks:
    """services/telemetry/tracing.py itself (on or off)."""

    def __init__(self, endpoint: str | None) -> None:
        from services.telemetry import tracing
        from services.telemetry.config import TracingConfig

        self.t = tracing
        self.CLIENT = tracing.CLIENT
        if endpoint:
            tracing.configure(TracingConfig(endpoint, 1.0), "gtr-gateway")

    def span(self, name: str, kind: Any = None) -> Any:
        return self.t.span(name, kind or self.t.INTERNAL)

    def server_span(self, name: str, traceparent: str, attributes: Any = None) -> Any:
        return self.t.server_span(
            name, self.t.from_pairs([("traceparent", traceparent)]), attributes
        )

    def batch_span(self, name: str, members: list[Any]) -> Any:
        return self.t.batch_span(name, members)

    def capture(self) -> Any:
        return self.t.capture()

    def traceparent(self) -> str:
        return self.t.traceparent()[0]

    def exemplar(self) -> Any:
        return self.t.exemplar()

    def flush(self) -> None:
        recorder = self.t._recorder
        if recorder is not None:
            recorder.processor.force_flush()

    def shutdown(self) -> None:
        self.t.shutdown()


def one_search(h: Any, traceparent: str, old_spans: bool) -> None:
    """The spans of one hybrid search, top 10, alone in its wave: the gateway's, then each
    shard's (``old_spans``: with the gateway's ``index search`` and a wave span, as before)."""
    with h.server_span("/retrieval.v1.SearchService/Search", traceparent) as root:
        with h.span("encode") as encode:
            with h.span("triton infer", h.CLIENT) as infer:
                if infer:
                    infer.set_attributes({"gtr.model": "embed", "gtr.texts": 1})
                h.traceparent()  # the infer call's headers
            if encode:
                encode.set_attribute("gtr.cached", 0)
        index = h.span("index search") if old_spans else contextlib.nullcontext()
        with index as span:
            attributes = {"gtr.generation": "g1", "gtr.queries": 1}
            if span:
                span.set_attributes(attributes)
            elif hasattr(h, "t"):
                h.t.annotate(attributes)
            member = h.capture()
            if old_spans and isinstance(h, OurHooks):  # a wave span, as batch_span made before
                wave = h.span("index wave")
            else:
                wave = h.batch_span("index wave", [member])
            with wave as batch:
                if old_spans and isinstance(h, OurHooks):
                    batch.set_attribute("gtr.batch.requests", 1)
                for shard in range(SHARDS):
                    with h.span("shard search", h.CLIENT) as call:
                        if call:
                            call.set_attributes(
                                {
                                    "gtr.shard": shard,
                                    "gtr.queries": 1,
                                    "gtr.dense_k": 10,
                                    "gtr.sparse_k": 10,
                                }
                            )
                        shard_search(h, h.traceparent())
        with h.span("fusion") as fusion:
            if fusion:
                fusion.set_attributes({"gtr.fusion": "rrf", "gtr.queries": 1})
        with h.span("document fetch", h.CLIENT) as fetch:
            if fetch:
                fetch.set_attributes({"db.system": "redis", "gtr.documents": 20})
        for _ in range(3):  # the encode, stage and RPC latency observations
            h.exemplar()
        if root:
            root.set_attributes(
                {
                    "rpc.system": "grpc",
                    "rpc.service": "retrieval.v1.SearchService",
                    "rpc.method": "Search",
                    "rpc.grpc.status_code": 0,
                }
            )


def shard_search(h: Any, traceparent: str) -> None:
    with h.server_span("retrieval.v1.IndexShardService/SearchStream search", traceparent):
        with h.span("dense search (IVF-PQ)") as dense:
            if dense:
                dense.set_attributes({"gtr.queries": 1, "gtr.k": 10, "gtr.nprobe": 8})
        with h.span("BM25 search (Tantivy)") as sparse:
            if sparse:
                sparse.set_attributes({"gtr.queries": 1, "gtr.k": 10})
        h.exemplar()


def child(variant: str, endpoint: str, searches: int) -> dict[str, float]:
    """One variant in this process: CPU per search (µs), all threads and the main one."""
    hooks: Any
    if variant.startswith("sdk"):
        hooks = SdkHooks(endpoint, lean_encoder=variant == "sdk+encoder")
    else:
        hooks = OurHooks(None if variant == "off" else endpoint)
    old_spans = variant in ("sdk", "sdk+encoder", "recorder-15")
    parents = [f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01" for _ in range(searches)]

    async def run(n: int) -> None:
        for parent in parents[:n]:
            one_search(hooks, parent, old_spans)

    asyncio.run(run(200))  # warm-up: imports, the channel to the receiver
    hooks.flush()
    cpu, main = time.process_time(), time.thread_time()
    asyncio.run(run(searches))
    main = time.thread_time() - main
    hooks.flush()
    cpu = time.process_time() - cpu
    hooks.shutdown()
    return {"cpu_us": cpu / searches * 1e6, "main_thread_us": main / searches * 1e6}


RECEIVER = """
import sys, time
from tests.support.otlp import otlp_receiver
with otlp_receiver() as r:
    print(r.grpc_port, flush=True)
    while sys.stdin.read(1):
        pass
"""


@contextlib.contextmanager
def receiver() -> Iterator[str]:
    """An OTLP/gRPC receiver in a process of its own (its CPU is not the variants')."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", RECEIVER],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        yield f"http://127.0.0.1:{int(proc.stdout.readline())}"
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--searches", type=int, default=3000, help="Searches per variant run.")
    parser.add_argument("--rounds", type=int, default=3, help="Runs of each variant.")
    parser.add_argument("--no-save", action="store_true", help=f"Do not write {RESULT}.")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:  # a child
        print(json.dumps(child(args.variant, args.endpoint, args.searches)))
        return 0
    loadavg = Path("/proc/loadavg").read_text().split()[:3]
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
        "PYTHONPATH": str(ROOT),
        "OTEL_BSP_MAX_QUEUE_SIZE": str(16 * args.searches + 4096),
    }
    with receiver() as endpoint:
        for r in range(args.rounds):
            for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
                argv = ["--variant", variant, "--endpoint", endpoint, "--searches"]
                out = subprocess.run(
                    [sys.executable, "-m", "bench.tracing_spans", *argv, str(args.searches)],
                    cwd=ROOT,
                    env=env,
                    check=True,
                    capture_output=True,
                    text=True,
                )
                got = json.loads(out.stdout.strip().splitlines()[-1])
                runs[variant].append(got)
                say(f"round {r + 1} {variant}: {got['cpu_us']:.0f} us CPU per search")
    spans = {"sdk": 15, "sdk+encoder": 15, "recorder-15": 15, "recorder": 13, "off": 0}
    result: dict[str, Any] = {"searches": args.searches, "rounds": args.rounds, "variants": {}}
    for variant, got in runs.items():
        cpu = statistics.median(g["cpu_us"] for g in got)
        main_thread = statistics.median(g["main_thread_us"] for g in got)
        result["variants"][variant] = {
            "spans_per_search": spans[variant],
            "cpu_us_per_search": round(cpu, 1),
            "main_thread_us_per_search": round(main_thread, 1),
            "export_thread_us_per_search": round(cpu - main_thread, 1),
            "cpu_us_per_span": round(cpu / spans[variant], 1) if spans[variant] else None,
            "rounds_cpu_us": [round(g["cpu_us"], 1) for g in got],
        }
    result["loadavg_at_start"] = loadavg
    result["loadavg_at_end"] = Path("/proc/loadavg").read_text().split()[:3]
    print(json.dumps(result))
    if not args.no_save:
        RESULT.parent.mkdir(parents=True, exist_ok=True)
        RESULT.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
