"""How the local stack runs Triton: the default model's ONNX export (made once), the
generated repository, the server's ports and TLS, its readiness."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from services.stack.children import Child, free_port
from services.stack.components import certificates
from services.stack.config import StackConfig

if TYPE_CHECKING:
    from services.encoder.serve.triton_server import TritonServerConfig
    from services.rpc.tls import ClientTLS

Say = Callable[[str], None]


EXPORT_DIRS = {"fp32": "export", "int8": "export-int8"}


def onnx_export(cfg: StackConfig, say: Say) -> Path:
    """The ONNX export of the default model, made once and cached under the run dir:
    ``export/`` (FP32) or ``export-int8/`` (with the int8 query tower, whose gates refuse
    it with FailedPrecondition; the gates' figures in its ``query_int8.json``).

    ``query_precision`` "auto" (``up``'s default): the export a run dir already has (the
    one its first ``up`` made, whose digest generation g1 records), else the int8 one
    when its gates pass (with no BEIR data: the quality result committed for the default
    model's graphs, services/encoder/build/int8_record.py), else FP32, saying why."""
    from services.common.errors import FailedPrecondition

    export = {p: cfg.run_dir / d / "model.onnx" for p, d in EXPORT_DIRS.items()}
    made = {p: (path.parent / "encoder.json").exists() for p, path in export.items()}
    precision = cfg.query_precision
    if precision == "auto":
        if made["int8"] or not made["fp32"]:
            try:
                return _export(cfg, "int8", say)
            except FailedPrecondition as exc:
                say(f"encoder    FP32 queries: {exc}")
        else:
            say(
                f"encoder    FP32 queries: {export['fp32'].parent} is this run dir's export "
                "(--query-precision int8 switches it to the int8 query tower)"
            )
        precision = "fp32"
    return _export(cfg, precision, say)


def _export(cfg: StackConfig, precision: str, say: Say) -> Path:
    from services.encoder.build.export import export_onnx
    from services.encoder.build.query_int8 import export_with_int8_query
    from services.encoder.model import default_model_dir

    onnx_path = cfg.run_dir / EXPORT_DIRS[precision] / "model.onnx"
    if not (onnx_path.exists() and (onnx_path.parent / "encoder.json").exists()):
        int8 = precision == "int8"
        say(
            "encoder    exporting the default model to ONNX"
            + (" with an int8 query tower (gated)" if int8 else "")
            + " (first run only)"
        )
        if int8:
            export_with_int8_query(default_model_dir(), onnx_path, None)
        else:
            export_onnx(default_model_dir(), onnx_path)
    if precision == "int8":
        say(f"encoder    int8 query tower (gates: {onnx_path.parent / 'query_int8.json'})")
    return onnx_path


def triton_server(cfg: StackConfig) -> TritonServerConfig:
    """How the stack runs Triton: free ports, the run's repository; ``--tls``: TLS and
    mTLS on gRPC. Its HTTP endpoint is closed: it has neither TLS nor authentication
    (under ``--tls`` it would answer ``/v2/models/embed/infer`` to anyone), and nothing
    of ours uses it (readiness is asked over gRPC, :func:`triton_ready`). Explicit model
    control: every version of the repository loaded at start (a restarted Triton serves
    the published ones too), and ``encoder publish`` (an index rollout to a new encoder)
    loads a new version while it serves (``services/encoder/serve/publish.py``)."""
    from services.encoder.serve.triton_server import (
        TritonServerConfig,
        grpc_tls_args,
        trace_args,
    )

    ports = [free_port(cfg.host) for _ in range(3)]
    certs = certificates(cfg)
    tracing = (
        trace_args(cfg.triton_otlp_endpoint, cfg.trace_sample_ratio)
        if cfg.triton_otlp_endpoint
        else ()
    )
    return TritonServerConfig(
        model_repository=cfg.model_repository,
        grpc_port=ports[0],
        http_port=ports[1],
        metrics_port=ports[2],
        host=cfg.host,
        backend_dir=cfg.run_dir / "triton-backends",
        http=False,
        model_control="explicit",
        extra_args=(
            *(grpc_tls_args(certs.server_cert, certs.server_key, certs.ca) if certs else ()),
            *tracing,
        ),
    )


def triton_child(cfg: StackConfig, say: Say) -> tuple[Child, str, str]:
    """(child, gRPC address, metrics address) of a Triton serving ``embed``.

    The repository is generated from the default model's export, unless it already holds
    encoder versions published beside the first (``encoder publish``, an index rollout to
    a new encoder): regenerating would drop them, and with them what a generation's
    queries are encoded with, so such a repository is kept as it is."""
    from services.encoder.build.repository import generate_repository
    from services.encoder.serve.triton_server import triton_command
    from services.encoder.serve.versions import served_versions

    repo = cfg.model_repository
    published = served_versions(repo) if (repo / "embed").is_dir() else []
    if any(v > 1 for v in published):
        say(f"triton     keeping {repo}: it serves encoder versions {published} (encoder publish)")
    else:
        generate_repository(onnx_export(cfg, say), repo)
    server = triton_server(cfg)
    argv, env = triton_command(server)
    child = Child("triton", argv, cfg.logs / "triton.log", env=env, job="triton")
    child.address = server.grpc_url
    child.metrics = f"{cfg.host}:{server.metrics_port}"
    return child, server.grpc_url, child.metrics


def triton_ready(grpc_address: str, model: str, tls: ClientTLS | None = None) -> bool:
    """Triton's ``model`` is ready, asked over gRPC (``tls``: the run's mTLS)."""
    from services.encoder.serve.triton_server import model_ready

    return model_ready(grpc_address, model, tls)
