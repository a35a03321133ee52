"""The gateway's client of Triton over mTLS: a real tritonserver started with
``--grpc-use-ssl --grpc-use-ssl-mutual`` (the flags of ``grpc_tls_args``, as ``up --tls``
starts it), serving the tiny GTR-layout T5 repository, and the gateway's TritonEncoder
configured as ``--tls-ca/--tls-client-cert/--tls-client-key`` configure it.

With the CA and the client certificate it embeds; without a client certificate, with
one from another CA, or in plaintext it gets no answer (UNAVAILABLE, mapped through
the one error map), so the hop is really encrypted and really authenticated.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np
import psutil
import pytest

from services.common.errors import RetrievalError, Unavailable
from services.encoder.build.repository import RepositoryConfig, generate_repository
from services.encoder.runtime.triton_client import TritonEncoder, TritonEncoderConfig
from services.encoder.serve.triton_server import TritonHandle, run_triton
from services.rpc.tls import ClientTLS
from services.stack import components, triton_component
from services.stack.certs import CertFiles, make_certs
from services.stack.config import StackConfig
from tests.encoder_fixtures import encoder_base, ensure_onnx, ensure_tiny_t5


@dataclass
class SecureTriton:
    handle: TritonHandle
    certs: CertFiles
    other: CertFiles


@pytest.fixture(scope="module")
def triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureTriton]:
    """Triton as ``up --tls`` runs it (the flags of ``triton_component.triton_server``), on the
    tiny repository."""
    base = encoder_base(tmp_path_factory)
    tmp = tmp_path_factory.mktemp("triton-tls")
    cfg = StackConfig(run_dir=tmp / "run", tls=True)
    certs = components.certificates(cfg)
    assert certs is not None
    other = make_certs(tmp / "other", common_name="someone else's CA")
    onnx_path = ensure_onnx(ensure_tiny_t5(base), base)
    generate_repository(
        onnx_path, cfg.model_repository, RepositoryConfig(instances=1, intra_op_threads=1)
    )
    server = replace(triton_component.triton_server(cfg), startup_timeout_s=120)
    with run_triton(server, tmp / "triton.log", tls=components.internal_tls(cfg)) as handle:
        yield SecureTriton(handle, certs, other)


async def _embed(handle: TritonHandle, tls: ClientTLS | None) -> np.ndarray:
    encoder = await TritonEncoder.connect(
        TritonEncoderConfig(url=handle.grpc_url, tls=tls, retries=0, connect_timeout_s=5.0)
    )
    try:
        return (await encoder.encode(["a query about tls"], "query")).vectors
    finally:
        await encoder.close()


def test_the_gateways_encoder_embeds_over_mtls(triton: SecureTriton) -> None:
    certs = triton.certs
    vectors = asyncio.run(
        _embed(triton.handle, ClientTLS(certs.ca, certs.client_cert, certs.client_key))
    )
    assert vectors.shape[0] == 1 and vectors.shape[1] > 0
    assert np.isclose(np.linalg.norm(vectors[0]), 1.0, atol=1e-3)


@pytest.mark.parametrize("who", ["plaintext", "no-client-cert", "other-ca-client-cert"])
def test_triton_under_mtls_refuses_a_client_it_cannot_verify(
    triton: SecureTriton, who: str
) -> None:
    certs, other = triton.certs, triton.other
    tls = {
        "plaintext": None,
        "no-client-cert": ClientTLS(certs.ca),
        "other-ca-client-cert": ClientTLS(certs.ca, other.client_cert, other.client_key),
    }[who]
    with pytest.raises(RetrievalError) as refused:
        asyncio.run(_embed(triton.handle, tls))
    assert isinstance(refused.value, Unavailable), refused.value


def test_under_tls_tritons_plaintext_http_endpoint_is_closed(triton: SecureTriton) -> None:
    """``up --tls`` closes Triton's HTTP endpoint, which has neither TLS nor tokens: the
    KServe v2 HTTP inference (what answered embeddings to anyone before) finds nothing
    listening on its port, and the server listens on its gRPC (mTLS) and metrics ports
    only. The control: the same server embeds over gRPC with the client certificate
    (``test_the_gateways_encoder_embeds_over_mtls``) and its metrics answer."""
    cfg = triton.handle.config
    body = {"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": ["x"]}]}
    infer = urllib.request.Request(
        f"http://{cfg.host}:{cfg.http_port}/v2/models/{cfg.ready_model}/infer",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(ConnectionRefusedError):
        try:
            urllib.request.urlopen(infer, timeout=10)
        except urllib.error.URLError as exc:
            raise exc.reason from None  # type: ignore[misc]

    def ipv4(ip: str) -> str:  # the metrics server's IPv6 socket: ::ffff:127.0.0.1
        address = ipaddress.ip_address(ip)
        mapped = getattr(address, "ipv4_mapped", None)
        return str(mapped or address)

    listening = {
        (ipv4(c.laddr.ip), c.laddr.port)
        for c in psutil.Process(triton.handle.process.pid).net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN
    }
    # on the stack's host only: without HTTP, Triton would bind its metrics on 0.0.0.0
    assert listening == {(cfg.host, cfg.grpc_port), (cfg.host, cfg.metrics_port)}, listening
    with urllib.request.urlopen(f"http://{cfg.host}:{cfg.metrics_port}/metrics", timeout=10) as r:
        assert r.status == 200
