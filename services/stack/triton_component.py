"""How the local stack runs Triton: the default model's ONNX export (made once), the
generated repository, the server's ports and TLS, its readiness."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from services.process.private import make_private
from services.stack.children import Child, free_port
from services.stack.components import certificates
from services.stack.config import StackConfig

if TYPE_CHECKING:
    from services.encoder.serve.triton_server import TritonServerConfig
    from services.rpc.tls import ClientTLS

Say = Callable[[str], None]


# (query precision, document precision) → the run dir's export folder, in the order
# "auto" prefers them
EXPORT_DIRS = {
    ("int8", "int8"): "export-int8-docs",
    ("int8", "fp32"): "export-int8",
    ("fp32", "fp32"): "export",
}


def onnx_export(cfg: StackConfig, say: Say) -> Path:
    """The ONNX export of the default model, made once and cached under the run dir:
    ``export/`` (FP32), ``export-int8/`` (the int8 query tower) or ``export-int8-docs/``
    (the int8 graph serving documents too); an int8 export's gates refuse it with
    FailedPrecondition, their figures in its ``query_int8.json``.

    "auto" (``up``'s default for queries; for documents when unasked and the run dir has
    an export, else FP32 documents): the export a run dir already has (the
    one its first ``up`` made, whose digest generation g1 records, and whose document
    vectors the stored indexes hold), else the most int8 one whose gates pass (with no
    BEIR data: the quality result committed for the default model's graphs,
    services/encoder/build/int8_record.py), saying why each refused one was."""
    from services.common.errors import FailedPrecondition, InvalidArgument
    from services.encoder.build.document_int8 import DocumentsRefused

    documents = cfg.document_precision
    if documents is None:  # unasked: the run dir's documents, else FP32 ones
        kept = [p for p in EXPORT_DIRS if (cfg.run_dir / EXPORT_DIRS[p] / "encoder.json").exists()]
        documents = "auto" if any(cfg.query_precision in ("auto", p[0]) for p in kept) else "fp32"
    candidates = [
        pair
        for pair in EXPORT_DIRS
        if cfg.query_precision in ("auto", pair[0]) and documents in ("auto", pair[1])
    ]
    if not candidates:
        raise InvalidArgument(
            "int8 documents come with int8 queries (their quality is measured as a pair): "
            "--document-precision int8 with --query-precision auto or int8"
        )
    made = [p for p in candidates if (cfg.run_dir / EXPORT_DIRS[p] / "encoder.json").exists()]
    if made:
        if made[0] != candidates[0]:
            say(
                f"encoder    {_describe(made[0])}: {cfg.run_dir / EXPORT_DIRS[made[0]]} is this "
                "run dir's export (--query-precision/--document-precision int8 switch it)"
            )
        return _export(cfg, made[0], say)
    while True:
        pair = candidates.pop(0)
        try:
            return _export(cfg, pair, say)
        except FailedPrecondition as exc:
            refused = 1 if isinstance(exc, DocumentsRefused) else 0  # else the query tower
            candidates = [p for p in candidates if p[refused] != "int8"]
            if not candidates:  # the precision asked for is refused: not downgraded
                raise
            say(f"encoder    FP32 {('queries', 'documents')[refused]}: {exc}")


def _describe(pair: tuple[str, str]) -> str:
    return {
        ("int8", "int8"): "int8 queries and documents",
        ("int8", "fp32"): "int8 queries, FP32 documents",
    }.get(pair, "FP32 queries and documents")


def _export(cfg: StackConfig, pair: tuple[str, str], say: Say) -> Path:
    from services.encoder.build.export import export_onnx
    from services.encoder.build.query_int8 import export_with_int8_query
    from services.encoder.model import default_model_dir

    onnx_path = cfg.run_dir / EXPORT_DIRS[pair] / "model.onnx"
    documents = pair[1] == "int8"
    if not (onnx_path.exists() and (onnx_path.parent / "encoder.json").exists()):
        what = {
            ("int8", "int8"): " with int8 queries and documents (gated)",
            ("int8", "fp32"): " with an int8 query tower (gated)",
        }.get(pair, "")
        say(f"encoder    exporting the default model to ONNX{what} (first run only)")
        if pair[0] == "int8":
            export_with_int8_query(default_model_dir(), onnx_path, None, documents=documents)
        else:
            export_onnx(default_model_dir(), onnx_path)
    if pair[0] == "int8":
        say(f"encoder    {_describe(pair)} (gates: {onnx_path.parent / 'query_int8.json'})")
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


def triton_nice(cfg: StackConfig) -> int:
    """Triton's session nice: ``cfg.triton_nice`` while the gateway embeds the queries
    (Triton's work is then documents only: the writers' and a rollout's), else 0: a
    search's encode is Triton's too."""
    return cfg.triton_nice if cfg.query_encoder == "gateway" else 0


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
    # copied in with their sources' modes (the model code, the backend's stub and
    # library: 0644 and 0755 whatever the umask): the run directory's owner's only
    make_private(repo)
    if server.backend_dir is not None:
        make_private(server.backend_dir)
    child = Child("triton", argv, cfg.logs / "triton.log", env=env, job="triton")
    child.nice = triton_nice(cfg)
    child.address = server.grpc_url
    child.metrics = f"{cfg.host}:{server.metrics_port}"
    return child, server.grpc_url, child.metrics


def triton_ready(grpc_address: str, model: str, tls: ClientTLS | None = None) -> bool:
    """Triton's ``model`` is ready, asked over gRPC (``tls``: the run's mTLS)."""
    from services.encoder.serve.triton_server import model_ready

    return model_ready(grpc_address, model, tls)
