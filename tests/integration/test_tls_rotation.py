"""Certificates rotated on disk, no process restarted: a real server built by
``services/rpc/server.py`` under mTLS and the index router's replica client, both
reading their PEM files from folders whose files are replaced (as a renewed Kubernetes
Secret replaces them), with two throwaway CAs (``services/stack/certs.py``).

* a new connection gets the new server certificate, and the server takes client
  certificates of the new CA only;
* a streaming call opened before the rotation (the health service's Watch) goes on
  and still gets its messages;
* the client builds a new channel with its new files (a new handshake, the new client
  certificate) and closes the old one once the call on it ended;
* a certificate whose key is not there yet is not taken: the old pair stays in use.
* the gateway's HTTP/JSON port (an aiohttp server on the same files) takes the new
  certificate and client CA on its next handshake as well.
"""

from __future__ import annotations

import asyncio
import http.client
import os
import shutil
import socket
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.index.client.replicas import HedgePolicy, Replica
from services.rpc.server import Server, create_server
from services.rpc.settings import ServiceSettings
from services.rpc.tls import ClientTLS, aio_channel
from services.stack.certs import CertFiles, make_certs

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class Pki:
    one: CertFiles
    two: CertFiles  # the next CA: what the rotation installs
    server_dir: Path  # what the server reads: server.pem, server.key, client-ca.pem
    client_dir: Path  # what the client reads: ca.pem, client.pem, client.key

    def install(self, certs: CertFiles, *, key: bool = True, cert: bool = True) -> None:
        """Replace the files in place (write beside, rename over), as a Secret update."""
        pairs = [
            (certs.ca, self.server_dir / "client-ca.pem"),
            (certs.ca, self.client_dir / "ca.pem"),
        ]
        if key:
            pairs += [
                (certs.server_key, self.server_dir / "server.key"),
                (certs.client_key, self.client_dir / "client.key"),
            ]
        if cert:
            pairs += [
                (certs.server_cert, self.server_dir / "server.pem"),
                (certs.client_cert, self.client_dir / "client.pem"),
            ]
        for src, dst in pairs:
            tmp = dst.with_suffix(".new")
            shutil.copyfile(src, tmp)
            os.replace(tmp, dst)

    def settings(self) -> ServiceSettings:
        return ServiceSettings(
            port=0,
            tls_cert=str(self.server_dir / "server.pem"),
            tls_key=str(self.server_dir / "server.key"),
            tls_client_ca=str(self.server_dir / "client-ca.pem"),
        )

    def client_tls(self) -> ClientTLS:
        d = self.client_dir
        return ClientTLS(d / "ca.pem", d / "client.pem", d / "client.key")


@pytest.fixture(scope="module")
def cas(tmp_path_factory: pytest.TempPathFactory) -> tuple[CertFiles, CertFiles]:
    tmp = tmp_path_factory.mktemp("cas")
    return make_certs(tmp / "one"), make_certs(tmp / "two", common_name="the next CA")


@pytest.fixture
def pki(cas: tuple[CertFiles, CertFiles], tmp_path: Path) -> Iterator[Pki]:
    server_dir, client_dir = tmp_path / "server", tmp_path / "client"
    server_dir.mkdir()
    client_dir.mkdir()
    pki = Pki(cas[0], cas[1], server_dir, client_dir)
    pki.install(pki.one)
    yield pki


def served_certificate(port: int, certs: CertFiles) -> bytes:
    """The DER certificate a new TLS connection to ``port`` is given (presenting
    ``certs``' client certificate, trusting nothing: only the bytes are looked at)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    ctx.load_cert_chain(certs.client_cert, certs.client_key)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with ctx.wrap_socket(raw) as tls:
            der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def der(path: Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(path.read_text())


async def check(port: int, tls: ClientTLS) -> grpc.StatusCode:
    """A health check over a new channel built from ``tls``' files as they are now."""
    async with aio_channel(f"127.0.0.1:{port}", tls) as channel:
        try:
            await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


async def start(pki: Pki) -> Server:
    server, _ = await create_server(pki.settings(), lambda _: [])
    return server


def test_a_rotated_certificate_reaches_new_connections_and_spares_a_running_stream(
    pki: Pki,
) -> None:
    async def main() -> None:
        server = await start(pki)
        replica = Replica(0, f"127.0.0.1:{server.port}", HedgePolicy(), pki.client_tls())
        replica.connections.check_every_s = 0  # compare the files at every use
        try:
            assert served_certificate(server.port, pki.one) == der(pki.one.server_cert)
            with replica.connections.use() as before:
                watch = health_pb2_grpc.HealthStub(before.channel).Watch(
                    health_pb2.HealthCheckRequest()
                )
                assert (await watch.read()).status == SERVING

                pki.install(pki.two)

                # new connections: the new certificate, and client certificates of the
                # new CA only
                assert served_certificate(server.port, pki.two) == der(pki.two.server_cert)
                one = ClientTLS(pki.one.ca, pki.one.client_cert, pki.one.client_key)
                assert await check(server.port, one) == grpc.StatusCode.UNAVAILABLE
                two = ClientTLS(pki.two.ca, pki.two.client_cert, pki.two.client_key)
                assert await check(server.port, two) == grpc.StatusCode.OK
                # the replica's client took its new files: a new channel whose handshake
                # the server (now CA two only) accepted
                assert await replica.serving()
                assert replica.connections.rotations == 1
                assert replica.channel is not before.channel
                # the stream opened before the rotation still gets its messages
                await server.set_serving(False)
                assert (await asyncio.wait_for(watch.read(), 5)).status == NOT_SERVING
                watch.cancel()
            # its last call ended: the replaced channel is closed
            async with asyncio.timeout(5):
                while before.channel.get_state() != grpc.ChannelConnectivity.SHUTDOWN:
                    await asyncio.sleep(0.01)
        finally:
            await replica.close()
            await server.stop(0)

    asyncio.run(main())


def test_a_certificate_without_its_key_yet_is_not_taken(pki: Pki) -> None:
    async def main() -> None:
        server = await start(pki)
        try:
            pki.install(pki.two, key=False)  # the new certificate, the old key
            assert served_certificate(server.port, pki.one) == der(pki.one.server_cert)
            pki.install(pki.two)  # now the key too
            assert served_certificate(server.port, pki.two) == der(pki.two.server_cert)
        finally:
            await server.stop(0)

    asyncio.run(main())


def test_a_server_refuses_to_start_with_a_key_of_another_certificate(pki: Pki) -> None:
    shutil.copyfile(pki.two.server_key, pki.server_dir / "server.key")
    with pytest.raises(ValueError, match="do not match"):
        pki.settings()


def test_the_http_port_takes_rotated_files_on_its_next_handshake(pki: Pki) -> None:
    """The gateway's HTTP/JSON port (the same files, through ``ServerTLS.ssl_context``):
    a new connection gets the new certificate, and the new client CA decides who may
    connect (mTLS)."""
    from grpc_health.v1._async import HealthServicer

    from services.rpc.admission import Admission
    from services.rpc.http.rules import public_routes
    from services.rpc.http.server import Transcoder, start_http_server

    def health(port: int, certs: CertFiles) -> int | str:
        ctx = ssl.create_default_context(cafile=str(certs.ca))
        ctx.load_cert_chain(certs.client_cert, certs.client_key)
        connection = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=5)
        try:
            connection.request("GET", "/v1/health")
            return connection.getresponse().status
        except (ssl.SSLError, ConnectionError) as exc:
            return type(exc).__name__
        finally:
            connection.close()

    async def main() -> None:
        routes = [r for r in public_routes() if r.method == "Check"]
        transcoder = Transcoder.build(
            routes, {"grpc.health.v1.Health": HealthServicer()}, admission=Admission()
        )
        tls = pki.settings().server_tls()
        assert tls is not None
        server = await start_http_server(
            transcoder, "127.0.0.1", 0, max_body_bytes=1024, ssl_context=tls.ssl_context()
        )
        try:
            port = server.port
            assert await asyncio.to_thread(served_certificate, port, pki.one) == der(
                pki.one.server_cert
            )
            assert await asyncio.to_thread(health, port, pki.one) == 200
            pki.install(pki.two)
            assert await asyncio.to_thread(served_certificate, port, pki.two) == der(
                pki.two.server_cert
            )
            assert await asyncio.to_thread(health, port, pki.two) == 200
            assert await asyncio.to_thread(health, port, pki.one) != 200  # the old CA's
        finally:
            await server.stop(0)

    asyncio.run(main())
