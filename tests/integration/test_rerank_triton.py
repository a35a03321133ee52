"""The ``rerank`` Python-backend model in a real tritonserver (nvidia-pytriton wheel).

Scores must match the in-process scorer on the same (tiny, untrained) checkpoint;
invalid requests get INVALID_ARG and the server keeps answering.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from services.rerank.checkpoint import load_checkpoint
from services.rerank.scorer import CeliScorer
from services.rerank.triton_repository import TritonRerankConfig, write_rerank_model
from tests.support.processes import free_port
from tests.support.rerank import tiny_checkpoint

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("rerank-triton"), WORDS)


@pytest.fixture(scope="module")
def triton(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    try:
        from services.encoder.triton_server import TritonServerConfig, pytriton_root, run_triton

        pytriton_root()
    except Exception as exc:  # FailedPrecondition: no wheel on this platform
        pytest.fail(f"tritonserver is not available (nvidia-pytriton installs it): {exc}")
    repo = tmp_path_factory.mktemp("repo")
    write_rerank_model(repo, TritonRerankConfig(checkpoint=checkpoint, threads=1))
    cfg = TritonServerConfig(repo, grpc_port=free_port(), http_port=free_port(),
                             metrics_port=free_port(), ready_model="rerank",
                             startup_timeout_s=120)  # fmt: skip
    with run_triton(cfg, repo.parent / "triton-rerank.log") as handle:
        yield handle.grpc_url


def _infer(url: str, query: list[bytes], docs: list[bytes]) -> np.ndarray:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    q = grpcclient.InferInput("QUERY", [len(query)], "BYTES")
    q.set_data_from_numpy(np.array(query, dtype=object))
    d = grpcclient.InferInput("DOCS", [len(docs)], "BYTES")
    d.set_data_from_numpy(np.array(docs, dtype=object))
    try:
        return np.asarray(client.infer("rerank", [q, d]).as_numpy("SCORES"))
    finally:
        client.close()


def test_triton_scores_match_in_process(triton: str, checkpoint: Path) -> None:
    docs = ["alpha beta", "gamma delta epsilon " * 20, "", "zeta"]
    got = _infer(triton, [b"alpha gamma"], [d.encode() for d in docs])
    model, tok, cfg = load_checkpoint(checkpoint)
    want = CeliScorer(model, tok, cfg, "x").score("alpha gamma", docs)
    assert got.dtype == np.float32 and got.shape == (4,)
    assert np.allclose(got, want, atol=1e-4)


def test_invalid_request_is_rejected_and_server_survives(triton: str) -> None:
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException, match="query must not be empty"):
        _infer(triton, [b""], [b"alpha"])
    assert _infer(triton, [b"alpha"], [b"beta"]).shape == (1,)
