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

Rotation without a restart (a renewed Secret, cert-manager's renewal before expiry):

* a PEM file is read once and again only when it changed on disk (:func:`read_pem`
  compares its inode, size and modification time; a Kubernetes Secret volume swaps a
  symlink, which changes them), so many channels built from one file cost one read;
* a server's certificate, key and client CA are offered through gRPC's dynamic
  credentials (:meth:`ServerTLS.credentials`): every new connection's handshake asks
  whether the files changed and, if so, uses the new ones; connections already open
  (and the calls on them, streams included) go on with the certificate they were made
  with; the gateway's HTTP/JSON port takes the same files the same way through an
  :class:`ssl.SSLContext` (:meth:`ServerTLS.ssl_context`, :class:`ServerSSL`);
* a client's channel is rebuilt when one of its files changed (:class:`Rotating`,
  checked at most once a second on use): new calls go over a new channel (a new
  handshake, the new client certificate, the new CA); the old channel is closed once
  the calls that were using it have ended.

A half-written pair (a certificate whose key is not there yet) is not taken: the
process keeps what it has and tries again on the next handshake or check.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import grpc

log = logging.getLogger(__name__)

# (device, inode, size, mtime in ns) of a file; None when it cannot be read
FileVersion = tuple[int, int, int, int] | None

_pem_lock = threading.Lock()
_pem_cache: dict[str, tuple[FileVersion, bytes]] = {}


def file_version(path: str | Path) -> FileVersion:
    """What tells a changed file from the one read before (None: no such file)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def read_pem(path: str | Path, what: str) -> bytes:
    """The bytes of a PEM file, read again only when it changed on disk; ValueError
    naming ``what`` when it cannot be read or is not PEM (so a wrong path stops a process
    at start with one clear line)."""
    key = os.path.abspath(path)
    version = file_version(path)
    with _pem_lock:
        cached = _pem_cache.get(key)
    if cached is not None and version is not None and cached[0] == version:
        return cached[1]
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{what} {path}: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{what} {path} is not a PEM file")
    with _pem_lock:
        _pem_cache[key] = (version, data)
    return data


def check_key_pair(cert: str | Path, key: str | Path, what: str) -> None:
    """ValueError unless ``key`` is the private key of ``cert`` (a pair caught half-way
    through a rotation, or two files mixed up)."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(f"{what} {cert} and its key {key} do not match: {exc}") from None


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
        check_key_pair(self.cert, self.key, "TLS certificate")
        if self.client_ca:
            read_pem(self.client_ca, "TLS client CA")

    def version(self) -> tuple[FileVersion, ...]:
        return tuple(file_version(p) for p in (self.cert, self.key, self.client_ca) if p)

    def configuration(self) -> grpc.ServerCertificateConfiguration:
        """The certificate, key and client CA as they are on disk now."""
        self.check()
        return grpc.ssl_server_certificate_configuration(
            [(read_pem(self.key, "TLS key"), read_pem(self.cert, "TLS certificate"))],
            root_certificates=(
                read_pem(self.client_ca, "TLS client CA") if self.client_ca else None
            ),
        )

    def ssl_context(self) -> ssl.SSLContext:
        """The files as a server's :class:`ssl.SSLContext`, rotated as the gRPC port's are
        (:class:`ServerSSL`)."""
        return ServerSSL(self).context

    def credentials(self) -> grpc.ServerCredentials:
        """Dynamic credentials: each new connection takes the files as they are then."""
        return grpc.dynamic_ssl_server_credentials(
            self.configuration(),
            ServerCertificates(self).fetch,
            require_client_authentication=self.client_ca is not None,
        )


class ServerCertificates:
    """gRPC's certificate configuration fetcher for one server: asked at every new
    connection's handshake (in a gRPC thread), answers None while the files are
    unchanged, the new configuration once they changed. Files that do not make a pair
    yet (half-way through a rotation) are logged once and the old ones kept."""

    def __init__(self, tls: ServerTLS) -> None:
        self.tls = tls
        self.version = tls.version()
        self._refused: tuple[FileVersion, ...] | None = None
        self.reloads = 0

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        version = self.tls.version()
        if version == self.version or version == self._refused:
            return None
        try:
            configuration = self.tls.configuration()
        except Exception as exc:  # in gRPC's handshake thread: never raise there
            self._refused = version
            log.warning(
                "TLS files changed but cannot be used yet (%s); keeping the certificate in use", exc
            )
            return None
        self.version = version
        self.reloads += 1
        log.info("TLS certificate %s changed on disk: new connections use it", self.tls.cert)
        return configuration


class ServerSSL:
    """The same files as an :class:`ssl.SSLContext`, for a server that is not gRPC's (the
    gateway's HTTP/JSON port): TLS 1.2 or later, a client certificate signed by the client
    CA required when there is one. Every handshake (the context's SNI callback, which
    OpenSSL calls with or without a name) checks whether the files changed and, if so,
    hands the connection a context built from the new ones; a pair that does not match
    yet is logged once and the old one kept, as :class:`ServerCertificates` does."""

    def __init__(self, tls: ServerTLS) -> None:
        self.tls = tls
        self.version = tls.version()
        self.current = self._build()
        self.context = self._build()  # the listening socket's; hands over to `current`
        self.context.sni_callback = self._pick
        self._refused: tuple[FileVersion, ...] | None = None
        self.reloads = 0

    def _build(self) -> ssl.SSLContext:
        self.tls.check()
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.tls.cert, self.tls.key)
        if self.tls.client_ca:
            context.load_verify_locations(cafile=str(self.tls.client_ca))
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def _pick(self, connection: Any, _server_name: str | None, _context: Any) -> None:
        version = self.tls.version()
        if version != self.version and version != self._refused:
            try:
                current = self._build()
            except Exception as exc:  # in the handshake: never raise there
                self._refused = version
                log.warning(
                    "TLS files changed but cannot be used yet (%s); keeping the certificate in use",
                    exc,
                )
            else:
                self.current, self.version = current, version
                self.reloads += 1
                log.info(
                    "TLS certificate %s changed on disk: new connections use it",
                    self.tls.cert,
                )
        connection.context = self.current


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
            check_key_pair(self.cert, self.key, "TLS client certificate")

    def version(self) -> tuple[FileVersion, ...]:
        return tuple(file_version(p) for p in (self.ca, self.cert, self.key) if p)

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


def speaks_tls(address: str, timeout: float = 3.0) -> bool | None:
    """Whether the server at ``address`` (``host:port``, a ``dns:///`` or ``ipv4:`` target
    of one address) answers a TLS handshake: True when it does, False when it answers
    something else (a plaintext server), None when it cannot be reached or the address is
    not one host and port. Its certificate is not checked and no client certificate is
    offered: this tells a TLS server from a plaintext one, nothing more. What lets a client
    say why a server closes its connections, where gRPC reports only "Socket closed" for a
    plaintext client of a TLS server (and for a TLS client without the client certificate
    an mTLS server requires)."""
    import socket

    target = address.split("///", 1)[-1].removeprefix("ipv4:").removeprefix("ipv6:")
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    try:
        with (
            socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as raw,
            context.wrap_socket(raw),
        ):
            return True
    except ssl.SSLEOFError:
        return None  # closed before answering: nothing said either way
    except ssl.SSLError as exc:
        # an alert is a TLS server refusing this handshake; anything else is not TLS
        return "ALERT" in f"{exc.reason} {exc}".upper()
    except OSError:
        return None


T = TypeVar("T")


class Rotating(Generic[T]):
    """A client's connection (a channel, a Triton client) built from TLS files, built
    again when one of them changes on disk.

    ``build()`` makes one (reading the files through :func:`read_pem`); ``retire(old)``
    closes one. :meth:`use` hands out the current one and counts the calls on it; the
    files are compared with the ones it was built from at most every ``check_every_s``,
    and when they changed (and make a valid pair) new calls get a new one while the old
    one is retired once its last call ended. Without TLS nothing is ever rebuilt.
    """

    def __init__(
        self,
        build: Callable[[], T],
        retire: Callable[[T], Awaitable[None]],
        tls: ClientTLS | None,
        what: str,
        check_every_s: float = 1.0,
    ) -> None:
        self._build = build
        self._retire = retire
        self._tls = tls
        self.what = what
        self.check_every_s = check_every_s
        self._version = tls.version() if tls is not None else ()
        self._current = build()
        self._checked = time.monotonic()
        self._uses: dict[int, int] = {}
        self._idle: dict[int, asyncio.Event] = {}
        self._retiring: set[asyncio.Task[None]] = set()
        self._refused: tuple[FileVersion, ...] | None = None
        self.rotations = 0

    @property
    def current(self) -> T:
        """The one new calls use (rebuilt first if the files changed)."""
        self._check()
        return self._current

    @contextlib.contextmanager
    def use(self) -> Iterator[T]:
        """The current one, counted as in use until the block ends."""
        obj = self.current
        key = id(obj)
        self._uses[key] = self._uses.get(key, 0) + 1
        try:
            yield obj
        finally:
            left = self._uses[key] - 1
            if left:
                self._uses[key] = left
            else:
                del self._uses[key]
                idle = self._idle.pop(key, None)
                if idle is not None:
                    idle.set()

    def _check(self) -> None:
        if self._tls is None:
            return
        now = time.monotonic()
        if now - self._checked < self.check_every_s:
            return
        self._checked = now
        version = self._tls.version()
        if version == self._version or version == self._refused:
            return
        try:
            self._tls.check()
            new = self._build()
        except ValueError as exc:
            self._refused = version
            log.warning(
                "%s: TLS files changed but cannot be used yet (%s); keeping the connection in use",
                self.what,
                exc,
            )
            return
        self._version = version
        old, self._current = self._current, new
        self.rotations += 1
        log.info("%s: TLS files changed on disk; new calls use a new connection", self.what)
        task = asyncio.ensure_future(self._drain(old))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _drain(self, old: T, timeout: float = 300.0) -> None:
        """Retire ``old`` once no call uses it (calls end by their deadlines; bounded
        anyway)."""
        try:
            if id(old) in self._uses:
                idle = self._idle.setdefault(id(old), asyncio.Event())
                async with asyncio.timeout(timeout):
                    await idle.wait()
        except TimeoutError:
            log.warning(
                "%s: calls still on the replaced connection after %.0f s; closing it",
                self.what,
                timeout,
            )
        finally:
            await self._retire(old)

    async def close(self) -> None:
        retiring = list(self._retiring)
        for task in retiring:
            task.cancel()
        await asyncio.gather(*retiring, return_exceptions=True)
        await self._retire(self._current)
