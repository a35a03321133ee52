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


def onnx_export(cfg: StackConfig, say: Say) -> Path:
    """The ONNX export of the default model, made once and cached under the run dir
    (``export/``; ``export-int8/`` with the int8 query tower, ``--query-precision int8``,
    whose gates refuse it with FailedPrecondition)."""
    from services.encoder.build.export import export_onnx
    from services.encoder.build.query_int8 import default_quality_data, export_with_int8_query
    from services.encoder.model import default_model_dir

    int8 = cfg.query_precision == "int8"
    onnx_path = cfg.run_dir / ("export-int8" if int8 else "export") / "model.onnx"
    if not (onnx_path.exists() and (onnx_path.parent / "encoder.json").exists()):
        say(
            "encoder    exporting the default model to ONNX"
            + (" with an int8 query tower (gated)" if int8 else "")
            + " (first run only)"
        )
        if int8:
            export_with_int8_query(default_model_dir(), onnx_path, default_quality_data())
        else:
            export_onnx(default_model_dir(), onnx_path)
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
