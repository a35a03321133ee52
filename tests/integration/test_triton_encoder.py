"""A real tritonserver (from the nvidia-pytriton wheel) serving the generated CPU repository.

One server per model per module: all-MiniLM-L6-v2 (the default model) and the tiny
GTR-layout T5. Driven over gRPC by TritonEncoder and by the raw Triton client, as a
caller would; embeddings are compared with the in-process PyTorch model.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from services.common.errors import DeadlineExceeded, InvalidArgument, Unavailable
from services.encoder.export import row_cosines
from services.encoder.model import default_model_dir
from services.encoder.repository import RepositoryConfig, generate_repository
from services.encoder.triton_client import TritonEncoder, TritonEncoderConfig, triton_client
from services.encoder.triton_server import TritonHandle, TritonServerConfig, run_triton
from tests.encoder_fixtures import (
    SAMPLE_DOCUMENTS,
    SAMPLE_QUERIES,
    encoder_base,
    ensure_onnx,
    ensure_tiny_t5,
    torch_embedder,
)
from tests.support.processes import free_port


def _serve(model_dir: Path, base: Path, name: str) -> Iterator[TritonHandle]:
    onnx_path = ensure_onnx(model_dir, base)
    repo = base / f"repo-{name}"
    generate_repository(onnx_path, repo, RepositoryConfig(instances=1, intra_op_threads=1))
    cfg = TritonServerConfig(repo, grpc_port=free_port(), http_port=free_port(),
                             metrics_port=free_port(), startup_timeout_s=90)  # fmt: skip
    with run_triton(cfg, base / f"triton-{name}.log") as handle:
        yield handle


@pytest.fixture(scope="module")
def minilm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonHandle]:
    yield from _serve(default_model_dir(), encoder_base(tmp_path_factory), "minilm")


@pytest.fixture(scope="module")
def tiny_t5(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonHandle]:
    base = encoder_base(tmp_path_factory)
    yield from _serve(ensure_tiny_t5(base), base, "tiny-t5")


def _raw_infer(handle: TritonHandle, texts: list[bytes], kinds: list[bytes]) -> np.ndarray:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(handle.grpc_url)
    text_in = grpcclient.InferInput("TEXT", [len(texts), 1], "BYTES")
    text_in.set_data_from_numpy(np.array(texts, dtype=object).reshape(-1, 1))
    kind_in = grpcclient.InferInput("KIND", [len(kinds), 1], "BYTES")
    kind_in.set_data_from_numpy(np.array(kinds, dtype=object).reshape(-1, 1))
    try:
        return np.asarray(client.infer("embed", [text_in, kind_in]).as_numpy("EMBEDDING"))
    finally:
        client.close()


async def _with_encoder(handle: TritonHandle, fn, **cfg):  # type: ignore[no-untyped-def]
    encoder = await TritonEncoder.connect(TritonEncoderConfig(handle.grpc_url, **cfg))
    try:
        return await fn(encoder)
    finally:
        await encoder.close()


@pytest.mark.parametrize("which", ["minilm", "tiny_t5"])
def test_embeddings_match_in_process(which: str, request: pytest.FixtureRequest,
                                     tmp_path_factory: pytest.TempPathFactory) -> None:  # fmt: skip
    handle: TritonHandle = request.getfixturevalue(which)
    model_dir = (default_model_dir() if which == "minilm"
                 else ensure_tiny_t5(encoder_base(tmp_path_factory)))  # fmt: skip
    reference = torch_embedder(model_dir)

    async def go(enc: TritonEncoder) -> None:
        assert (enc.model_name, enc.dim, enc.max_batch) == (reference.model_name, reference.dim, 64)
        for texts, kind in ((SAMPLE_QUERIES, "query"), (SAMPLE_DOCUMENTS, "document")):
            got = await enc.encode(texts, kind, timeout=10)  # type: ignore[arg-type]
            want, _ = reference.embed(texts, kind)  # type: ignore[arg-type]
            assert got.vectors.dtype == np.float32 and got.vectors.shape == want.shape
            assert np.allclose(np.linalg.norm(got.vectors, axis=1), 1.0, atol=1e-5)
            assert min(row_cosines(got.vectors, want)) >= 0.9999
            assert got.truncated == [False] * len(texts)

    asyncio.run(_with_encoder(handle, go))


def test_long_text_is_truncated_and_flagged(minilm: TritonHandle) -> None:
    long = " ".join(f"word{i}" for i in range(2000))
    reference = torch_embedder(default_model_dir())

    async def go(enc: TritonEncoder) -> None:
        got = await enc.encode([long, "short one"], "document", timeout=10)
        assert got.truncated == [True, False]
        want, flags = reference.embed([long, "short one"], "document")
        assert flags == [True, False] and min(row_cosines(got.vectors, want)) >= 0.9999

    asyncio.run(_with_encoder(minilm, go))


def test_concurrent_single_requests_are_batched_correctly(minilm: TritonHandle) -> None:
    texts = [f"{q} number {i}" for i in range(4) for q in SAMPLE_QUERIES]  # 16 texts
    reference, _ = torch_embedder(default_model_dir()).embed(texts, "query")

    async def go(enc: TritonEncoder) -> None:
        results = await asyncio.gather(*(enc.encode([t], "query", timeout=20) for t in texts))
        got = np.concatenate([r.vectors for r in results])
        assert min(row_cosines(got, reference)) >= 0.9999

    asyncio.run(_with_encoder(minilm, go))


@pytest.mark.parametrize(
    ("texts", "kinds", "message"),
    [
        ([b""], [b"query"], "text 0 is empty"),
        ([b"fine", b"\xc3\x28 bad"], [b"query", b"query"], "text 1 is not valid UTF-8"),
        ([b"hello"], [b"passage"], "kind 'passage' of row 0 is unknown"),
        ([b"x"] * 65, [b"query"] * 65, "batch-size must be <= 64"),
    ],
)
def test_bad_input_gets_a_clear_error_and_the_model_survives(
    minilm: TritonHandle, texts: list[bytes], kinds: list[bytes], message: str
) -> None:
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException, match=message) as info:
        _raw_infer(minilm, texts, kinds)
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert _raw_infer(minilm, [b"still alive"], [b"query"]).shape == (1, 384)


def test_server_side_rejection_maps_to_invalid_argument(minilm: TritonHandle) -> None:
    async def go(enc: TritonEncoder) -> None:
        enc.max_batch = 1000  # skip the client-side check: let Triton refuse the batch
        with pytest.raises(InvalidArgument, match="batch-size must be <= 64"):
            await enc.encode(["x"] * 65, "query", timeout=10)
        assert (await enc.encode(["ok"], "query", timeout=10)).vectors.shape == (1, 384)

    asyncio.run(_with_encoder(minilm, go))


def test_client_side_validation(minilm: TritonHandle) -> None:
    async def go(enc: TritonEncoder) -> None:
        with pytest.raises(InvalidArgument, match="empty"):
            await enc.encode(["ok", " "], "query")
        with pytest.raises(InvalidArgument, match="over the limit of 64"):
            await enc.encode(["x"] * 65, "query")
        with pytest.raises(InvalidArgument, match="unknown kind"):
            await enc.encode(["x"], "passage")  # type: ignore[arg-type]

    asyncio.run(_with_encoder(minilm, go))


def test_deadline_is_sent_to_triton(minilm: TritonHandle) -> None:
    docs = [" ".join(f"w{i}{j}" for i in range(300)) for j in range(64)]

    async def go(enc: TritonEncoder) -> None:
        with pytest.raises(DeadlineExceeded):
            await enc.encode(docs, "document", timeout=0.005)
        assert (await enc.encode(["ok"], "query", timeout=10)).vectors.shape == (1, 384)

    asyncio.run(_with_encoder(minilm, go))


def test_unreachable_server_is_unavailable() -> None:
    port = free_port()  # nothing listens there

    async def go() -> None:
        with pytest.raises(Unavailable):
            await TritonEncoder.connect(TritonEncoderConfig(f"127.0.0.1:{port}",
                                                            connect_timeout_s=2))  # fmt: skip

    asyncio.run(go())


def test_retries_on_unavailable_until_the_deadline(minilm: TritonHandle) -> None:
    """A connected encoder whose server goes away retries, then reports Unavailable."""

    async def go() -> None:
        dead = f"127.0.0.1:{free_port()}"
        cfg = TritonEncoderConfig(dead, retries=2, backoff_s=0.01)
        enc = TritonEncoder(triton_client(cfg), cfg, "all-MiniLM-L6-v2", 384, 64)
        try:
            with pytest.raises(Unavailable, match="embedding 1 texts"):
                await enc.encode(["x"], "query", timeout=5)
        finally:
            await enc.close()

    asyncio.run(go())
