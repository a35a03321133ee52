"""Where trace spans go and how many: from a service's flags, else the environment
variables of the OpenTelemetry specification (read when a process starts, never at import)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

ENDPOINT_HELP = (
    "OpenTelemetry: export trace spans over OTLP/gRPC to this collector "
    "(http://host:4317; https:// for TLS). Unset: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or "
    "OTEL_EXPORTER_OTLP_ENDPOINT, else tracing is off (no span is made; docs/tracing.md)."
)
RATIO_HELP = (
    "Share of the traces that start here which are recorded (0..1); a request whose "
    "traceparent says sampled (or not) keeps its caller's decision. Unset: "
    "OTEL_TRACES_SAMPLER_ARG, else 1."
)


@dataclass(frozen=True)
class TracingConfig:
    """``endpoint``: the OTLP/gRPC collector (None: tracing off); ``ratio``: the share of
    new traces recorded (a request's own sampled flag wins: parent-based sampling)."""

    endpoint: str | None = None
    ratio: float = 1.0

    @property
    def enabled(self) -> bool:
        return bool(self.endpoint)

    @classmethod
    def resolve(
        cls, endpoint: str | None, ratio: float | None, environ: Mapping[str, str]
    ) -> TracingConfig:
        """The flags' values, else the OpenTelemetry variables in ``environ``
        (``OTEL_SDK_DISABLED=true`` turns tracing off whatever else says)."""
        if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return cls(None, 1.0)
        if not endpoint:
            endpoint = (
                environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                or None
            )
        if ratio is None:
            raw = environ.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
            try:
                ratio = float(raw) if raw else 1.0
            except ValueError:
                raise ValueError(f"OTEL_TRACES_SAMPLER_ARG: {raw!r} is not a number") from None
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"trace sample ratio {ratio} is outside 0..1")
        return cls(endpoint, ratio)
