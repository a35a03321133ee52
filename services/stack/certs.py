"""A throwaway certificate authority and the certificates signed by it, for the local
stack (``gtr-retrieval up --tls``) and the tests; ``scripts/make_certs.py`` is its
command line.

One CA (``ca.pem``, ``ca.key``), one server certificate (``server.pem``/``server.key``)
whose subject alternative names are ``localhost``, ``127.0.0.1``, ``::1`` and any
names given (a chart's Service DNS names), used by every server of ours (gateway,
shards, rerank, Triton); it also has the client-auth usage, so that one certificate
can be both sides of mTLS (the chart's ``tls.crt``). And one client certificate
(``client.pem``/``client.key``) that our own clients present under mTLS. ECDSA P-256
keys, SHA-256 signatures. Keys are written with mode 0600. Not for production: there,
certificates come from your PKI or cert-manager (docs/deploy.md).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # cryptography is imported when certificates are made, not at import
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

SERVER_NAMES = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class CertFiles:
    """Where the PEM files of one throwaway CA live."""

    dir: Path

    @property
    def ca(self) -> Path:
        return self.dir / "ca.pem"

    @property
    def ca_key(self) -> Path:
        return self.dir / "ca.key"

    @property
    def server_cert(self) -> Path:
        return self.dir / "server.pem"

    @property
    def server_key(self) -> Path:
        return self.dir / "server.key"

    @property
    def client_cert(self) -> Path:
        return self.dir / "client.pem"

    @property
    def client_key(self) -> Path:
        return self.dir / "client.key"

    def exist(self) -> bool:
        return all(
            p.exists()
            for p in (self.ca, self.server_cert, self.server_key, self.client_cert, self.client_key)
        )


def _san(name: str):  # type: ignore[no-untyped-def]
    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _write(path: Path, data: bytes, secret: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    fd = os.open(path, flags, 0o600 if secret else 0o644)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


@dataclass(frozen=True)
class _Authority:
    """The CA that signs the leaves, and the validity every certificate shares."""

    key: ec.EllipticCurvePrivateKey
    name: x509.Name
    cert: x509.Certificate
    start: datetime.datetime
    end: datetime.datetime


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _name(cn: str) -> x509.Name:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _new_ca(common_name: str, days: int) -> _Authority:
    """A self-signed CA valid from 5 minutes ago for ``days`` days."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_usage = x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=True,
        crl_sign=True,
        encipher_only=False,
        decipher_only=False,
    )
    ca_name = _name(common_name)
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(ca_usage, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )
    return _Authority(ca_key, ca_name, ca, start, end)


def _leaf(
    ca: _Authority, cn: str, usages: list[x509.ObjectIdentifier], sans: Sequence[str]
) -> tuple[bytes, bytes]:
    """A certificate signed by ``ca`` and its key, both PEM."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(ca.name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(ca.start)
        .not_valid_after(ca.end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), False
        )
    )
    if sans:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([_san(s) for s in sans]), critical=False
        )
    cert = builder.sign(ca.key, hashes.SHA256())
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def make_certs(
    out_dir: Path,
    names: Sequence[str] = (),
    *,
    days: int = 30,
    common_name: str = "gtr-retrieval test CA",
) -> CertFiles:
    """Write a new CA, a server certificate for ``SERVER_NAMES`` + ``names`` and a client
    certificate into ``out_dir``; returns their paths."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID

    files = CertFiles(Path(out_dir))
    ca = _new_ca(common_name, days)
    server_names = list(dict.fromkeys([*SERVER_NAMES, *names]))
    server_pem, server_key = _leaf(
        ca,
        "gtr-retrieval server",
        [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
        server_names,
    )
    client_pem, client_key = _leaf(
        ca, "gtr-retrieval client", [ExtendedKeyUsageOID.CLIENT_AUTH], ()
    )
    _write(files.ca, ca.cert.public_bytes(serialization.Encoding.PEM))
    _write(files.ca_key, _key_pem(ca.key), secret=True)
    _write(files.server_cert, server_pem)
    _write(files.server_key, server_key, secret=True)
    _write(files.client_cert, client_pem)
    _write(files.client_key, client_key, secret=True)
    return files
