"""How a client reaches the gateway: its address, bearer token and TLS, from arguments or
from the environment variables the ``gtr-retrieval`` CLI reads, and the gRPC channel
built from them.

=========================  ==============================================================
variable                   meaning
=========================  ==============================================================
``GTR_GATEWAY_ADDRESS``    ``host:port`` of the gateway (default ``127.0.0.1:50051``,
                           where ``gtr-retrieval up`` listens unless told ``--port``)
``GTR_TOKEN``              bearer token, sent as ``authorization: Bearer <token>``
``GTR_TLS_CA``             PEM CA to trust: talk TLS to the gateway
``GTR_TLS_CLIENT_CERT``    PEM client certificate (mTLS), with ``GTR_TLS_CLIENT_KEY``
``GTR_TLS_CLIENT_KEY``     its key
=========================  ==============================================================

An argument wins over its variable; ``env=False`` reads none of them. The files are read
when the client is made (a bad path or a certificate that does not match its key is a
``ValueError`` naming the file then, not a failed handshake later).
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from retrieval import __version__

DEFAULT_ADDRESS = "127.0.0.1:50051"
ENV_ADDRESS = "GTR_GATEWAY_ADDRESS"
ENV_TOKEN = "GTR_TOKEN"
ENV_TLS_CA = "GTR_TLS_CA"
ENV_TLS_CLIENT_CERT = "GTR_TLS_CLIENT_CERT"
ENV_TLS_CLIENT_KEY = "GTR_TLS_CLIENT_KEY"
# What a channel receives: as much as the gateway sends by default (its --max-message-mb,
# 64), not gRPC's 4 MB default, which a search with many hits and their documents passes
# (search.proto's BatchSearchRequest says so).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
USER_AGENT = f"gtr-retrieval-client/{__version__}"


def _read_pem(path: str | Path, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{what} {path}: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{what} {path} is not a PEM file")
    return data


@dataclass(frozen=True)
class TLS:
    """TLS to the gateway: ``ca`` the PEM CA to trust (None: the system's roots), ``cert``
    and ``key`` a client certificate for a gateway that requires one (mTLS);
    ``server_name`` the name to check the gateway's certificate against when the address
    is not one it holds (an IP address, a tunnel)."""

    ca: str | Path | None = None
    cert: str | Path | None = None
    key: str | Path | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("a TLS client certificate and its key go together")

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> TLS | None:
        """TLS of ``GTR_TLS_CA`` / ``GTR_TLS_CLIENT_CERT`` / ``GTR_TLS_CLIENT_KEY``; None
        when none is set (plaintext)."""
        ca, cert, key = (
            env.get(name) or None for name in (ENV_TLS_CA, ENV_TLS_CLIENT_CERT, ENV_TLS_CLIENT_KEY)
        )
        if not (ca or cert or key):
            return None
        return cls(ca, cert, key)

    def credentials(self) -> grpc.ChannelCredentials:
        """The channel credentials of the files as they are now; ValueError naming a file
        that cannot be read, is not PEM, or (a client certificate) does not match its key."""
        root = _read_pem(self.ca, "TLS CA") if self.ca else None
        chain = key = None
        if self.cert and self.key:
            chain = _read_pem(self.cert, "TLS client certificate")
            key = _read_pem(self.key, "TLS client key")
            try:
                ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(self.cert, self.key)
            except (ssl.SSLError, OSError) as exc:
                raise ValueError(
                    f"TLS client certificate {self.cert} and its key {self.key} do not match: {exc}"
                ) from None
        return grpc.ssl_channel_credentials(
            root_certificates=root, private_key=key, certificate_chain=chain
        )


@dataclass(frozen=True)
class Target:
    """Where the gateway is and how to talk to it: address, bearer token (None: none), TLS
    (None: plaintext)."""

    address: str
    token: str | None = None
    tls: TLS | None = None

    @classmethod
    def resolve(
        cls,
        address: str | None = None,
        token: str | None = None,
        tls: TLS | bool | None = None,
        env: Mapping[str, str] | None = None,
    ) -> Target:
        """Arguments first, then ``env`` (the process's environment when None is given
        and ``env`` is not False at the caller): ``tls=True`` is TLS with the system's
        roots, ``tls=False`` plaintext whatever the environment says."""
        environ: Mapping[str, str] = os.environ if env is None else env
        if isinstance(tls, bool):
            chosen: TLS | None = TLS() if tls else None
        else:
            chosen = tls if tls is not None else TLS.from_env(environ)
        return cls(
            address or environ.get(ENV_ADDRESS) or DEFAULT_ADDRESS,
            token if token is not None else (environ.get(ENV_TOKEN) or None),
            chosen,
        )

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """What every call sends: the bearer token, when there is one."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def options(self, extra: Sequence[tuple[str, Any]] = ()) -> list[tuple[str, Any]]:
        options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.primary_user_agent", USER_AGENT),
        ]
        if self.tls is not None and self.tls.server_name:
            options.append(("grpc.ssl_target_name_override", self.tls.server_name))
        return [*options, *extra]

    def channel(self, extra: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        if self.tls is None:
            return grpc.insecure_channel(self.address, options=self.options(extra))
        return grpc.secure_channel(self.address, self.tls.credentials(), self.options(extra))

    def aio_channel(self, extra: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
        if self.tls is None:
            return grpc.aio.insecure_channel(self.address, options=self.options(extra))
        return grpc.aio.secure_channel(self.address, self.tls.credentials(), self.options(extra))
