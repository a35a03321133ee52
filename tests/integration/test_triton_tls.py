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
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from services.common.errors import RetrievalError, Unavailable
from services.common.tls import ClientTLS
from services.encoder.build.repository import RepositoryConfig, generate_repository
from services.encoder.runtime.triton_client import TritonEncoder, TritonEncoderConfig
from services.encoder.serve.triton_server import (
    TritonHandle,
    TritonServerConfig,
    grpc_tls_args,
    run_triton,
)
from services.stack.certs import CertFiles, make_certs
from tests.encoder_fixtures import encoder_base, ensure_onnx, ensure_tiny_t5
from tests.support.processes import free_port


@dataclass
class SecureTriton:
    handle: TritonHandle
    certs: CertFiles
    other: CertFiles


@pytest.fixture(scope="module")
def triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureTriton]:
    base = encoder_base(tmp_path_factory)
    tmp = tmp_path_factory.mktemp("triton-tls")
    certs = make_certs(tmp / "certs")
    other = make_certs(tmp / "other", common_name="someone else's CA")
    onnx_path = ensure_onnx(ensure_tiny_t5(base), base)
    repo = tmp / "repo"
    generate_repository(onnx_path, repo, RepositoryConfig(instances=1, intra_op_threads=1))
    cfg = TritonServerConfig(
        repo,
        grpc_port=free_port(),
        http_port=free_port(),
        metrics_port=free_port(),
        startup_timeout_s=120,
        extra_args=grpc_tls_args(certs.server_cert, certs.server_key, certs.ca),
    )
    with run_triton(cfg, tmp / "triton.log") as handle:
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
