"""InProcessEncoder (PyTorch and ONNX Runtime): the Encoder contract without a server."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest

from services.common.errors import DeadlineExceeded, InvalidArgument
from services.encoder.base import Embeddings, Encoder
from services.encoder.build.export import row_cosines
from services.encoder.model import default_model_dir
from services.encoder.runtime.inprocess import InProcessEncoder
from tests.encoder_fixtures import (
    SAMPLE_DOCUMENTS,
    SAMPLE_QUERIES,
    encoder_base,
    ensure_onnx,
    torch_embedder,
)


@pytest.fixture(scope="module")
def onnx_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_onnx(default_model_dir(), encoder_base(tmp_path_factory))


@pytest.fixture(scope="module")
def onnx_enc(onnx_path: Path) -> InProcessEncoder:
    return InProcessEncoder.onnx(onnx_path, threads=2)


def _encode(encoder: Encoder, texts, kind: str, timeout: float | None = None) -> Embeddings:
    return asyncio.run(encoder.encode(texts, kind, timeout))  # type: ignore[arg-type]


def test_torch_and_onnx_agree(onnx_enc: InProcessEncoder) -> None:
    torch_enc = InProcessEncoder(torch_embedder(default_model_dir()))
    assert (onnx_enc.dim, onnx_enc.model_name, onnx_enc.max_batch) == (384, "all-MiniLM-L6-v2", 64)
    for texts, kind in ((SAMPLE_QUERIES, "query"), (SAMPLE_DOCUMENTS, "document")):
        a, b = _encode(torch_enc, texts, kind), _encode(onnx_enc, texts, kind)
        assert a.vectors.dtype == np.float32 and a.vectors.shape == (len(texts), 384)
        assert min(row_cosines(a.vectors, b.vectors)) >= 0.9999
        assert a.truncated == b.truncated == [False] * len(texts)
    asyncio.run(torch_enc.close())


def test_queries_and_documents_differ_only_by_budget(onnx_enc: InProcessEncoder) -> None:
    enc = onnx_enc
    long = " ".join(SAMPLE_DOCUMENTS) + " " + " ".join(f"topic{i} changes" for i in range(200))
    q, d = _encode(enc, [long], "query"), _encode(enc, [long], "document")
    assert q.truncated == [True] and d.truncated == [True]
    assert row_cosines(q.vectors, d.vectors)[0] < 0.999  # 64 vs 256 tokens were embedded


@pytest.mark.parametrize(
    ("texts", "kind", "message"),
    [
        ([], "query", "no texts"),
        (["ok", ""], "query", "text 1 is empty"),
        (["ok"], "passage", "unknown kind"),
        ("a string", "query", "not one string"),
        (["x"] * 65, "query", "over the limit of 64"),
    ],
)
def test_invalid_requests_are_rejected_before_the_model(
    onnx_enc: InProcessEncoder, texts: list[str], kind: str, message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        _encode(onnx_enc, texts, kind)


class _SlowEmbedder:
    backend = "slow"
    model_name = "slow"
    dim = 2

    def __init__(self) -> None:
        from services.encoder.profiles import get_profile

        self.profile = get_profile("minilm")

    def embed(self, texts: list[str], kind: str) -> tuple[np.ndarray, list[bool]]:
        time.sleep(0.5)
        return np.ones((len(texts), 2), np.float32), [False] * len(texts)


def test_timeout_becomes_deadline_exceeded() -> None:
    enc = InProcessEncoder(_SlowEmbedder())
    with pytest.raises(DeadlineExceeded, match=r"longer than 0\.050 s"):
        _encode(enc, ["x"], "query", timeout=0.05)
    assert _encode(enc, ["x"], "query", timeout=5).vectors.shape == (1, 2)
