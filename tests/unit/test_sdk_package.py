"""The SDK stands alone: ``gtr_client`` imports nothing of the server (read with ``ast``,
every import wherever it stands), agrees with the gateway where the two must (the answer
size, the environment variables the CLI documents), and speaks the gRPC health service's
wire format without its package."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from grpc_health.v1 import health_pb2

from gtr_client import HealthStatus, connection, health
from services.rpc.settings import ServiceSettings

ROOT = Path(__file__).resolve().parents[2]
SDK = ROOT / "clients" / "python" / "gtr_client"
ALLOWED = {"grpc", "google", "retrieval", "gtr_client"}


def _imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_the_sdk_imports_only_the_standard_library_grpc_protobuf_and_the_contract() -> None:
    offending = {
        f"{path.name}: {name}"
        for path in sorted(SDK.glob("*.py"))
        for name in _imported(path)
        if name not in ALLOWED and name not in sys.stdlib_module_names
    }
    assert offending == set()


def test_the_sdk_receives_what_the_gateway_sends_by_default() -> None:
    default_mb = ServiceSettings.model_fields["max_message_mb"].default
    assert default_mb * 1024 * 1024 == connection.MAX_MESSAGE_BYTES


def test_the_cli_documents_the_environment_variables_the_sdk_reads() -> None:
    from services.cli.main import build_parser

    parser = build_parser()
    search = parser._subparsers._group_actions[0].choices["search"]  # type: ignore[union-attr,index]
    helps = " ".join(a.help or "" for a in search._actions)
    for name in (
        connection.ENV_ADDRESS,
        connection.ENV_TOKEN,
        connection.ENV_TLS_CA,
        connection.ENV_TLS_CLIENT_CERT,
        connection.ENV_TLS_CLIENT_KEY,
    ):
        assert f"${name}" in helps, name


def test_the_health_messages_are_the_health_services_on_the_wire() -> None:
    request = health_pb2.HealthCheckRequest.FromString(health.request("retrieval.v1.X"))
    assert request.service == "retrieval.v1.X"
    for number, status in enumerate(HealthStatus):
        wire = health_pb2.HealthCheckResponse(status=number).SerializeToString()  # type: ignore[arg-type]
        assert health.status(wire) is status
