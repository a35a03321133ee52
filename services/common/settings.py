"""Settings shared by every service, and the one way to load them.

Each service defines one pydantic-settings class (``services/<svc>/settings.py``)
that derives from :class:`ServiceSettings`. Values come from, in order of precedence:
command-line flags, environment variables (``GTR_<SERVICE>_<FIELD>``), defaults.
Nothing is read at import time; :func:`load_settings` validates everything at start
and turns a validation error into one clear message.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, TypeVar

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict


class ServiceSettings(BaseSettings):
    """What every gRPC process needs: where to listen, how to log, how to stop."""

    model_config = SettingsConfigDict(
        extra="forbid", validate_default=True, cli_kebab_case=True, cli_implicit_flags=True
    )

    host: str = Field("127.0.0.1", description="Interface to listen on (0.0.0.0 in a pod).")
    port: int = Field(0, ge=0, le=65535, description="gRPC port; 0 picks a free one.")
    metrics_port: int | None = Field(
        None, ge=0, le=65535, description="Prometheus /metrics port; unset = no endpoint."
    )
    log_format: Literal["text", "json"] = Field("text", description="Log line format.")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    grace_seconds: float = Field(
        5.0, ge=0, description="On SIGTERM, in-flight RPCs get this long to finish."
    )
    max_message_mb: int = Field(64, ge=1, le=1024, description="Max gRPC message size.")
    max_in_flight: int = Field(
        0,
        ge=0,
        description="Unary requests in flight at most; one more is refused at once with "
        "RESOURCE_EXHAUSTED and a retry-after-ms hint (health and reflection always "
        "answer). 0 = no limit.",
    )
    retry_after_ms: int = Field(
        100, ge=1, description="The retry-after-ms hint of a request refused over the limit."
    )
    health_interval_s: float = Field(
        1.0,
        gt=0,
        description="How often a background watcher checks what this process depends on "
        "(gateway: its Redis; index shard: its log consumer thread; rerank: nothing) and "
        "sets the gRPC health status to match.",
    )
    port_file: str | None = Field(
        None, description="Write the bound gRPC port to this file once serving (for launchers)."
    )


class SettingsError(SystemExit):
    """Raised (exit status 2) when the configuration is invalid; the text says why."""


S = TypeVar("S", bound=BaseSettings)


def load_settings(cls: type[S], argv: Sequence[str] | None = None, prog: str | None = None) -> S:
    """Build ``cls`` from flags (``argv``), environment and defaults, or exit with a message.

    ``argv=None`` reads no flags (environment and defaults only).
    """
    try:
        if argv is None:
            return cls()
        return cls(_cli_parse_args=list(argv), _cli_prog_name=prog)  # type: ignore[call-arg]
    except ValidationError as exc:
        lines = [f"invalid configuration for {cls.__name__}:"]
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or "(settings)"
            lines.append(f"  {where}: {err['msg']} (got {err.get('input')!r})")
        raise SettingsError("\n".join(lines)) from None
