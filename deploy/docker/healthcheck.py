"""Container health check of a gtr-retrieval process: its gRPC health service says SERVING.

Run by the image's HEALTHCHECK (Docker, Podman) beside the process it checks, PID 1
(``gtr-retrieval gateway|index|rerank serve ...``). It reads that process's settings as
the process does: its flags (``/proc/1/cmdline``, or the arguments given to this script)
before its environment (``GTR_GATEWAY_*``, ``GTR_SHARD_*``, ``GTR_RERANK_*``):

1. a plaintext health-only port (``--health-port``, ``GTR_<SERVICE>_HEALTH_PORT``, or
   ``GTR_HEALTH_PORT``): probed there, plaintext. This is the port for probes once the
   process serves TLS (the chart sets it with ``tls.enabled``);
2. else the serving port (``--port``, ``GTR_<SERVICE>_PORT``, else 50051): plaintext, or
   TLS when the process serves TLS (``--tls-cert``/``--tls-key``). Then the probe trusts
   the CA that signs the process's clients (``--tls-client-ca``), else its ``--tls-ca``,
   else the certificate itself; presents the process's own certificate when it requires
   client certificates (mTLS: the chart's one certificate has both usages); and checks
   the name the certificate carries (localhost, else its first DNS name).

Exit 0 when SERVING, 1 otherwise (the runtime's contract).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

# the role in ``gtr-retrieval <role> serve`` → its settings' environment prefix
PREFIXES = {"gateway": "GTR_GATEWAY", "index": "GTR_SHARD", "rerank": "GTR_RERANK"}
DEFAULT_PORT = 50051
TIMEOUT_S = 3.0


@dataclass(frozen=True)
class Probe:
    port: int
    cert: str | None = None  # the process serves TLS with this certificate
    key: str | None = None
    trust: str | None = None  # PEM roots to check it against
    client_auth: bool = False  # the process requires a client certificate


def process_args() -> list[str]:
    """PID 1's command line (the process this container runs); [] when unreadable."""
    try:
        raw = Path("/proc/1/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def flag(args: Sequence[str], name: str) -> str | None:
    """The value of ``--name value`` or ``--name=value`` (the last one wins, as argparse)."""
    found = None
    for i, arg in enumerate(args):
        if arg == f"--{name}" and i + 1 < len(args):
            found = args[i + 1]
        elif arg.startswith(f"--{name}="):
            found = arg.split("=", 1)[1]
    return found


def probe_of(args: Sequence[str], environ: Mapping[str, str]) -> Probe:
    roles = [PREFIXES[a] for a in args if a in PREFIXES]
    prefixes = roles[:1] or list(PREFIXES.values())

    def setting(name: str) -> str | None:
        value = flag(args, name.replace("_", "-"))
        if value:
            return value
        for prefix in prefixes:
            value = environ.get(f"{prefix}_{name.upper()}")
            if value:
                return value
        return None

    health_port = setting("health_port") or environ.get("GTR_HEALTH_PORT")
    if health_port:
        return Probe(int(health_port))
    port = int(setting("port") or DEFAULT_PORT)
    cert, key = setting("tls_cert"), setting("tls_key")
    if not (cert and key):
        return Probe(port)
    client_ca = setting("tls_client_ca")
    return Probe(
        port,
        cert=cert,
        key=key,
        trust=client_ca or setting("tls_ca") or cert,
        client_auth=bool(client_ca),
    )


def server_name(cert_pem: bytes) -> str | None:
    """The name to check the certificate against when dialling 127.0.0.1: None when it
    names 127.0.0.1 itself, else localhost, else its first DNS name (a wildcard's
    ``*`` filled in)."""
    try:
        from cryptography import x509
    except ImportError:
        return None
    cert = x509.load_pem_x509_certificate(cert_pem)
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    if "127.0.0.1" in [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)]:
        return None
    names = sans.get_values_for_type(x509.DNSName)
    if "localhost" in names:
        return "localhost"
    return names[0].replace("*", "healthcheck", 1) if names else None


def channel(probe: Probe) -> grpc.Channel:
    target = f"127.0.0.1:{probe.port}"
    if probe.cert is None or probe.key is None or probe.trust is None:
        return grpc.insecure_channel(target)
    cert = Path(probe.cert).read_bytes()
    credentials = grpc.ssl_channel_credentials(
        root_certificates=Path(probe.trust).read_bytes(),
        private_key=Path(probe.key).read_bytes() if probe.client_auth else None,
        certificate_chain=cert if probe.client_auth else None,
    )
    name = server_name(cert)
    options = [("grpc.ssl_target_name_override", name)] if name else []
    return grpc.secure_channel(target, credentials, options=options)


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """``argv``: the checked process's command line (default: PID 1's)."""
    args = list(argv) if argv else process_args()
    probe = probe_of(args, os.environ if environ is None else environ)
    how = "TLS" if probe.cert else "plaintext"
    where = f"127.0.0.1:{probe.port} ({how})"
    try:
        with channel(probe) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT_S
            )
    except grpc.RpcError as err:
        print(f"{where}: {err.code().name}", file=sys.stderr)
        return 1
    except OSError as err:  # a certificate file named but unreadable
        print(f"{where}: {err}", file=sys.stderr)
        return 1
    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
    if not serving:
        name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        print(f"{where}: {name}", file=sys.stderr)
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
