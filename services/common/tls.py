"""TLS and mutual TLS from PEM files, for every server and every client of ours.

Server side (gateway, index shard, rerank: ``--tls-cert``, ``--tls-key``,
``--tls-client-ca``): with a certificate and key the server speaks TLS only; with a
client CA too it requires a client certificate signed by that CA (mTLS), so a client
without one, or with one from another CA, fails the handshake.

Client side (the gateway's channels to shards, rerank and Triton; the CLI; the load
generator: ``--tls-ca``, ``--tls-client-cert``, ``--tls-client-key``): with a CA the
channel speaks TLS and trusts only servers whose certificate that CA signed (and whose
name matches the address, or ``server_name``); with a client certificate and key it
presents them (for mTLS). Without any of them the channel is plaintext.

Files are read when a server or channel is built; a process picks up new certificates
on restart (a rolling restart after a Secret rotation).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc


def read_pem(path: str | Path, what: str) -> bytes:
    """The bytes of a PEM file; ValueError naming ``what`` when it cannot be read or is
    not PEM (so a wrong path stops a process at start with one clear line)."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{what} {path}: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{what} {path} is not a PEM file")
    return data


@dataclass(frozen=True)
class ServerTLS:
    """A server's certificate and key, and the CA its clients' certificates must have
    (None: no client certificate asked for)."""

    cert: str | Path
    key: str | Path
    client_ca: str | Path | None = None

    @classmethod
    def from_paths(
        cls, cert: str | None, key: str | None, client_ca: str | None
    ) -> ServerTLS | None:
        """None when no certificate is configured; ValueError for half a configuration."""
        if not cert and not key:
            if client_ca:
                raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
            return None
        if not cert or not key:
            raise ValueError("--tls-cert and --tls-key go together")
        return cls(cert, key, client_ca or None)

    def check(self) -> None:
        read_pem(self.cert, "TLS certificate")
        read_pem(self.key, "TLS key")
        if self.client_ca:
            read_pem(self.client_ca, "TLS client CA")

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(read_pem(self.key, "TLS key"), read_pem(self.cert, "TLS certificate"))],
            root_certificates=(
                read_pem(self.client_ca, "TLS client CA") if self.client_ca else None
            ),
            require_client_auth=self.client_ca is not None,
        )


@dataclass(frozen=True)
class ClientTLS:
    """What a client trusts (``ca``) and, for mTLS, the certificate it presents.
    ``server_name`` overrides the name checked against the server's certificate (when
    the address is an IP or a name the certificate does not hold)."""

    ca: str | Path | None = None
    cert: str | Path | None = None
    key: str | Path | None = None
    server_name: str | None = None

    @classmethod
    def from_paths(
        cls,
        ca: str | Path | None,
        cert: str | Path | None = None,
        key: str | Path | None = None,
        server_name: str | None = None,
    ) -> ClientTLS | None:
        """None when nothing is configured (plaintext); ValueError for half a key pair."""
        if bool(cert) != bool(key):
            raise ValueError("--tls-client-cert and --tls-client-key go together")
        if not ca and not cert:
            return None
        return cls(ca or None, cert or None, key or None, server_name or None)

    def check(self) -> None:
        if self.ca:
            read_pem(self.ca, "TLS CA")
        if self.cert and self.key:
            read_pem(self.cert, "TLS client certificate")
            read_pem(self.key, "TLS client key")

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=read_pem(self.ca, "TLS CA") if self.ca else None,
            private_key=read_pem(self.key, "TLS client key") if self.key else None,
            certificate_chain=read_pem(self.cert, "TLS client certificate") if self.cert else None,
        )

    def options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def aio_channel(
    address: str, tls: ClientTLS | None, options: Sequence[tuple[str, Any]] = ()
) -> grpc.aio.Channel:
    """An asyncio channel to ``address``: TLS by ``tls``, plaintext without it."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, tls.credentials(), options=[*options, *tls.options()])


def channel(
    address: str, tls: ClientTLS | None, options: Sequence[tuple[str, Any]] = ()
) -> grpc.Channel:
    """A blocking channel to ``address``: TLS by ``tls``, plaintext without it."""
    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, tls.credentials(), options=[*options, *tls.options()])
