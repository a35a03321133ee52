"""Where the load goes and how to get in: address, bearer token, TLS / mTLS.

Loopback by default. ``--token`` (or ``GTR_TOKEN``) is sent as ``authorization: Bearer
<token>`` metadata on every call; ``--tls-ca`` switches to TLS with that CA, and
``--tls-client-cert``/``--tls-client-key`` add a client certificate (mTLS). The flags are
the ones the gateway's own CLI uses, so one command line fits both.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

DEFAULT_ADDRESS = "127.0.0.1:50051"


@dataclass(frozen=True)
class Target:
    address: str = DEFAULT_ADDRESS
    token: str | None = None
    tls_ca: Path | None = None
    tls_client_cert: Path | None = None
    tls_client_key: Path | None = None

    def __post_init__(self) -> None:
        if (self.tls_client_cert is None) != (self.tls_client_key is None):
            raise ValueError("--tls-client-cert and --tls-client-key go together")
        if self.tls_client_cert is not None and self.tls_ca is None:
            raise ValueError("a client certificate needs --tls-ca (mTLS is TLS first)")

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def credentials(self) -> grpc.ChannelCredentials | None:
        """TLS credentials, or None for a plaintext channel."""
        if self.tls_ca is None:
            return None
        cert = self.tls_client_cert.read_bytes() if self.tls_client_cert else None
        key = self.tls_client_key.read_bytes() if self.tls_client_key else None
        return grpc.ssl_channel_credentials(self.tls_ca.read_bytes(), key, cert)

    def aio_channel(self, index: int = 0) -> grpc.aio.Channel:
        """An asyncio channel; ``index`` gives each channel a connection of its own."""
        options = [("grpc.use_local_subchannel_pool", 1), ("loadtest.channel", index)]
        creds = self.credentials()
        if creds is None:
            return grpc.aio.insecure_channel(self.address, options=options)
        return grpc.aio.secure_channel(self.address, creds, options=options)

    def sync_channel(self) -> grpc.Channel:
        creds = self.credentials()
        if creds is None:
            return grpc.insecure_channel(self.address)
        return grpc.secure_channel(self.address, creds)


def target_from_stack(stack: dict[str, Any], token: str | None = None) -> Target:
    """The gateway of a ``gtr-retrieval up`` stack as its stack.json describes it: its
    address, a write token when it was started with ``--auth`` (unless ``token`` is
    given) and its CA when it was started with ``--tls``."""
    if token is None and stack.get("write_tokens_file"):
        token = Path(stack["write_tokens_file"]).read_text(encoding="utf-8").split()[0]
    tls = stack.get("client_tls") or {}
    return Target(stack["gateway"], token=token, tls_ca=Path(tls["ca"]) if tls else None)


def add_target_arguments(parser: argparse.ArgumentParser, address_flag: str = "--target") -> None:
    parser.add_argument(
        address_flag,
        dest="address",
        default=DEFAULT_ADDRESS,
        help=f"gateway host:port (default {DEFAULT_ADDRESS}; traffic goes nowhere else)",
    )
    parser.add_argument(
        "--token",
        default=None,
        help="bearer token sent as 'authorization: Bearer ...' (default: $GTR_TOKEN)",
    )
    parser.add_argument("--tls-ca", type=Path, default=None, help="CA bundle: use TLS")
    parser.add_argument("--tls-client-cert", type=Path, default=None, help="client cert (mTLS)")
    parser.add_argument("--tls-client-key", type=Path, default=None, help="client key (mTLS)")


def target_from_args(args: argparse.Namespace) -> Target:
    return Target(
        address=args.address,
        token=args.token or os.environ.get("GTR_TOKEN") or None,
        tls_ca=args.tls_ca,
        tls_client_cert=args.tls_client_cert,
        tls_client_key=args.tls_client_key,
    )
