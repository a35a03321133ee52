"""The chart's OpenTelemetry values (issue #36 item 3): off by default; given an OTLP
endpoint, the gateway, every shard replica and the reranker get it and the sample ratio
as the OpenTelemetry environment variables (which their settings read), and Triton its
``--trace-config`` flags, the same ones the local stack passes (``trace_args``)."""

from __future__ import annotations

from typing import Any

import pytest

from services.encoder.serve.triton_server import trace_args
from services.telemetry.config import TracingConfig
from tests.support.chart import (
    Manifest,
    chart,
    component,
    helm,
    render,
    the,
    validate,
    workloads,
)

__all__ = ["chart"]  # the module-scoped fixture, shared

TRACING = {
    "otlpEndpoint": "http://otel-collector.observability:4317",
    "sampleRatio": 0.25,
    "tritonOtlpEndpoint": "http://otel-collector.observability:4318/v1/traces",
}

RERANK = {"enabled": True, "checkpoint": {"existingClaim": "celi-checkpoint"}}


def _container(doc: Manifest) -> dict[str, Any]:
    container: dict[str, Any] = doc["spec"]["template"]["spec"]["containers"][0]
    return container


def _env(doc: Manifest) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in _container(doc).get("env", [])}


def test_tracing_is_off_by_default(chart: Any) -> None:
    docs = render(chart)
    for wl in workloads(docs):
        assert not any(name.startswith("OTEL_") for name in _env(wl)), component(wl)
    args = _container(the(docs, "Deployment", "triton"))["args"]
    assert not any(a.startswith("--trace-config") for a in args)


def test_an_otlp_endpoint_reaches_every_service_and_triton(chart: Any) -> None:
    docs = render(chart, {"tracing": TRACING, "rerank": RERANK})
    for doc in docs:
        if not doc["apiVersion"].startswith("monitoring.coreos.com/"):
            validate(doc)
    seen = set()
    for wl in workloads(docs):
        comp = component(wl)
        if comp not in {"gateway", "index", "rerank"}:
            continue
        seen.add(comp)
        env = _env(wl)
        config = TracingConfig.resolve(None, None, env)
        assert config == TracingConfig(TRACING["otlpEndpoint"], 0.25), comp  # type: ignore[arg-type]
    assert seen == {"gateway", "index", "rerank"}
    args = _container(the(docs, "Deployment", "triton"))["args"]
    traced = [a for a in args if a.startswith("--trace-config")]
    assert traced == list(trace_args(TRACING["tritonOtlpEndpoint"], 0.25))  # type: ignore[arg-type]
    assert "--trace-config=rate=4" in traced


@pytest.mark.parametrize("endpoint", ["otel-collector:4317", "http://a b"])
def test_an_endpoint_without_a_scheme_is_refused(chart: Any, endpoint: str) -> None:
    with pytest.raises(helm.HelmValuesError):
        chart.render({"tracing": {"otlpEndpoint": endpoint}}, name="r", namespace="n")
