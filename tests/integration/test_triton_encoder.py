"""A real tritonserver (from the nvidia-pytriton wheel) serving the generated CPU repository.

One server per model per module: all-MiniLM-L6-v2 (the default model) as ``up
--document-precision int8`` serves it, with its int8 graph for queries and documents (its
export made as ``up`` makes it, on a machine without BEIR data: the quality gates answered
by the committed record), and the tiny GTR-layout T5, FP32 (a model with no recorded
quality result gets no int8 graph).
Driven over gRPC by TritonEncoder and by the raw Triton client, as a caller would.

What is served is checked against what should be served: query and document vectors
against the export's graph of their kind run in process (an int8 graph one row per run,
as the model runs it) at cosine >= 0.9999, and against PyTorch at the threshold of that
graph's own gate (0.98 for int8, 0.9999 for FP32).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from services.common.errors import DeadlineExceeded, InvalidArgument, Unavailable
from services.encoder.build.export import (
    INT8_ONNX,
    PARITY_MIN_COSINE,
    EncoderMeta,
    row_cosines,
)
from services.encoder.build.query_int8 import INT8_PARITY_MIN_COSINE
from services.encoder.build.repository import RepositoryConfig, generate_repository
from services.encoder.model import default_model_dir
from services.encoder.runtime.onnx_embedder import OnnxEmbedder
from services.encoder.runtime.triton_client import (
    ENCODER_OUTPUT,
    KSERVE_SERVICE,
    TritonEncoder,
    TritonEncoderConfig,
)
from services.encoder.serve.triton_server import TritonHandle, TritonServerConfig, run_triton
from services.stack import triton_component
from services.stack.config import StackConfig
from tests.encoder_fixtures import (
    SAMPLE_DOCUMENTS,
    SAMPLE_QUERIES,
    encoder_base,
    ensure_onnx,
    ensure_tiny_t5,
    mixed_lengths,
    torch_embedder,
)
from tests.support.processes import await_until, free_port, wait_until


def _serve(onnx_path: Path, base: Path, name: str) -> Iterator[TritonHandle]:
    repo = base / f"repo-{name}"
    generate_repository(onnx_path, repo, RepositoryConfig(instances=1, intra_op_threads=1))
    cfg = TritonServerConfig(
        repo,
        grpc_port=free_port(),
        http_port=free_port(),
        metrics_port=free_port(),
        startup_timeout_s=90,
    )
    with run_triton(cfg, base / f"triton-{name}.log") as handle:
        yield handle


@pytest.fixture(scope="module")
def minilm_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's export as ``up --document-precision int8`` makes it, where no
    BEIR data is (``up``'s default, int8 queries and FP32 documents, serves the same query
    graph and the FP32 graph checked below for the tiny T5)."""
    run_dir = tmp_path_factory.mktemp("stack-export")
    with pytest.MonkeyPatch.context() as env:
        env.delenv("GTR_DATA_DIR", raising=False)
        cfg = StackConfig(run_dir=run_dir, document_precision="int8")
        return triton_component.onnx_export(cfg, lambda _: None)


@pytest.fixture(scope="module")
def minilm(minilm_export: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonHandle]:
    yield from _serve(minilm_export, encoder_base(tmp_path_factory), "minilm")


@pytest.fixture(scope="module")
def tiny_t5(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonHandle]:
    base = encoder_base(tmp_path_factory)
    yield from _serve(ensure_onnx(ensure_tiny_t5(base), base), base, "tiny-t5")


_SERVED: dict[Path, OnnxEmbedder] = {}


def assert_served(
    got: np.ndarray, texts: list[str], export: Path, model: Path, kind: str = "query"
) -> None:
    """``got`` are the ``kind`` vectors of ``export``'s graph of that kind (run in process
    as the model runs it) and within that graph's gate of PyTorch's."""
    if export not in _SERVED:
        _SERVED[export] = OnnxEmbedder(export, threads=1)
    served, _ = _SERVED[export].embed(texts, kind)  # type: ignore[arg-type]
    assert min(row_cosines(got, served)) >= 0.9999
    int8 = kind in EncoderMeta.read(export.parent).row_by_row()
    gate = INT8_PARITY_MIN_COSINE if int8 else PARITY_MIN_COSINE
    want, _ = torch_embedder(model).embed(texts, kind)  # type: ignore[arg-type]
    assert min(row_cosines(got, want)) >= gate


def test_the_default_model_with_int8_documents_is_served_one_int8_graph(
    minilm_export: Path,
) -> None:
    meta = EncoderMeta.read(minilm_export.parent)
    assert (meta.query_precision, meta.document_precision) == ("int8", "int8")
    assert meta.towers == {"query": INT8_ONNX, "document": INT8_ONNX}
    assert minilm_export.parent.name == triton_component.EXPORT_DIRS[("int8", "int8")]


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
def test_embeddings_match_in_process(
    which: str, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> None:
    handle: TritonHandle = request.getfixturevalue(which)
    base = encoder_base(tmp_path_factory)
    if which == "minilm":
        model_dir, export = default_model_dir(), request.getfixturevalue("minilm_export")
    else:
        model_dir = ensure_tiny_t5(base)
        export = ensure_onnx(model_dir, base)
    reference = torch_embedder(model_dir)

    async def go(enc: TritonEncoder) -> None:
        assert (enc.model_name, enc.dim, enc.max_batch) == (reference.model_name, reference.dim, 64)
        for texts, kind in ((SAMPLE_QUERIES, "query"), (SAMPLE_DOCUMENTS, "document")):
            got = await enc.encode(texts, kind, timeout=10)  # type: ignore[arg-type]
            want, _ = reference.embed(texts, kind)  # type: ignore[arg-type]
            assert got.vectors.dtype == np.float32 and got.vectors.shape == want.shape
            assert np.allclose(np.linalg.norm(got.vectors, axis=1), 1.0, atol=1e-5)
            assert_served(got.vectors, texts, export, model_dir, kind)
            assert got.truncated == [False] * len(texts)

    asyncio.run(_with_encoder(handle, go))


def test_long_text_is_truncated_and_flagged(minilm: TritonHandle, minilm_export: Path) -> None:
    long = " ".join(f"word{i}" for i in range(2000))
    reference = torch_embedder(default_model_dir())

    async def go(enc: TritonEncoder) -> None:
        got = await enc.encode([long, "short one"], "document", timeout=10)
        assert got.truncated == [True, False]
        _, flags = reference.embed([long, "short one"], "document")
        assert flags == [True, False]
        assert_served(
            got.vectors, [long, "short one"], minilm_export, default_model_dir(), "document"
        )

    asyncio.run(_with_encoder(minilm, go))


def test_documents_of_mixed_lengths_come_back_in_their_places(
    tiny_t5: TritonHandle, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """One request of interleaved short and long documents (an FP32 graph, so the model
    runs its rows in pieces by length): every row gets the vector it gets alone."""
    base = encoder_base(tmp_path_factory)
    export = ensure_onnx(ensure_tiny_t5(base), base)
    alone = OnnxEmbedder(export, threads=1)
    texts = mixed_lengths()
    batch = alone.tokenize(texts, "document")
    assert len(batch.pieces(1)) > 2  # the model runs one ONNX Runtime thread here

    async def go(enc: TritonEncoder) -> None:
        got = await enc.encode(texts, "document", timeout=20)
        want = np.concatenate([alone.embed([t], "document")[0] for t in texts])
        assert min(row_cosines(got.vectors, want)) >= 0.99999
        assert got.truncated == [alone.embed([t], "document")[1][0] for t in texts]

    asyncio.run(_with_encoder(tiny_t5, go))


def _embed_counts(handle: TritonHandle) -> tuple[int, int]:
    """Triton's own count of (requests answered, model executions) of ``embed``."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(handle.grpc_url)
    try:
        stats = client.get_inference_statistics("embed", as_json=True)["model_stats"][0]
    finally:
        client.close()
    return int(stats.get("inference_count", 0)), int(stats.get("execution_count", 0))


def test_concurrent_single_requests_are_batched_correctly(
    minilm: TritonHandle, minilm_export: Path
) -> None:
    """16 concurrent one-text calls: each gets its own text's embedding, and Triton's
    statistics show its dynamic batcher ran them in fewer model executions than calls."""
    texts = [f"{q} number {i}" for i in range(4) for q in SAMPLE_QUERIES]  # 16 texts
    answered, executions = _embed_counts(minilm)

    async def go(enc: TritonEncoder) -> None:
        results = await asyncio.gather(*(enc.encode([t], "query", timeout=20) for t in texts))
        got = np.concatenate([r.vectors for r in results])
        assert_served(got, texts, minilm_export, default_model_dir())

    asyncio.run(_with_encoder(minilm, go))
    # and one request of the client's own when it connects: the version's description,
    # asked of a model that has the ENCODER output (read_version_info; it runs no graph)
    described = int(ENCODER_OUTPUT in _output_names(minilm))
    # Triton counts a request just after it answered: wait for the count to arrive
    expected = answered + len(texts) + described
    wait_until(lambda: _embed_counts(minilm)[0] >= expected, f"Triton counts {expected}")
    answered_now, executions_now = _embed_counts(minilm)
    assert answered_now - answered == len(texts) + described
    assert executions_now - executions < len(texts) + described, "the batcher joined no calls"


def _output_names(handle: TritonHandle) -> set[str]:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(handle.grpc_url)
    try:
        config = client.get_model_config("embed", as_json=True)["config"]
    finally:
        client.close()
    return {o["name"] for o in config.get("output", [])}


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


@dataclass
class InferProxy:
    """A gRPC hop in front of the real Triton that sees what Triton is sent: it counts
    the ModelInfer attempts that reach it and the deadline each carries, fails the first
    ``fail_first`` with UNAVAILABLE (a Triton restarting), and forwards the others to
    Triton with the deadline it received."""

    upstream: str
    fail_first: int = 0
    attempts: int = 0
    deadlines: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def handle(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        with self.lock:
            self.attempts += 1
            attempt = self.attempts
            self.deadlines.append(context.time_remaining())
        if attempt <= self.fail_first:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"proxy: failure {attempt}")
        with grpc.insecure_channel(self.upstream) as channel:
            forward = channel.unary_unary(f"/{KSERVE_SERVICE}/ModelInfer")
            try:
                return forward(request, timeout=context.time_remaining())  # type: ignore[no-any-return]
            except grpc.RpcError as exc:
                context.abort(exc.code(), exc.details())  # type: ignore[attr-defined]
        raise AssertionError("unreachable")


@contextmanager
def proxied(handle: TritonHandle, fail_first: int = 0) -> Iterator[tuple[str, InferProxy]]:
    proxy = InferProxy(handle.grpc_url, fail_first)
    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    method = grpc.unary_unary_rpc_method_handler(proxy.handle)  # raw bytes both ways
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(KSERVE_SERVICE, {"ModelInfer": method}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", proxy
    finally:
        server.stop(0)


async def _proxied_encode(address: str, texts: list[str], timeout: float | None, **cfg: Any):  # type: ignore[no-untyped-def]
    config = TritonEncoderConfig(address, **cfg)
    enc = TritonEncoder(config, "all-MiniLM-L6-v2", 384, 64)
    try:
        return await enc.encode(texts, "query", timeout=timeout)
    finally:
        await enc.close()


def test_the_deadline_is_sent_to_triton(minilm: TritonHandle) -> None:
    """The server side of the wire sees the caller's deadline (and the default one when
    the caller brings none), so Triton can drop the work nobody waits for; the client's
    own DEADLINE_EXCEEDED alone would not show that."""
    docs = [" ".join(f"w{i}{j}" for i in range(60)) for j in range(64)]

    async def tight(address: str, proxy: InferProxy) -> None:
        config = TritonEncoderConfig(address)
        enc = TritonEncoder(config, "all-MiniLM-L6-v2", 384, 64)
        try:
            await enc.encode(["warm the channel up"], "query", timeout=30)  # connected now
            # A stall of 20 ms before the call leaves (a loaded machine) ends it in the
            # client, unsent: then again, until one reaches the proxy (it records a call
            # as it arrives, perhaps just after the client gave up).
            for _ in range(5):
                with pytest.raises(DeadlineExceeded):
                    await enc.encode(docs, "query", timeout=0.02)
                with contextlib.suppress(AssertionError):
                    await await_until(lambda: proxy.attempts > 1, "the call at the proxy", 1)
                    return
        finally:
            await enc.close()

    with proxied(minilm) as (address, proxy):
        asyncio.run(tight(address, proxy))
        # gRPC rounds a timeout up on the wire (its units): a few ms of slack
        assert proxy.attempts == 2 and 0 < proxy.deadlines[1] <= 0.03, proxy.deadlines
        got = asyncio.run(_proxied_encode(address, ["ok"], None, default_timeout_s=7.0))
        assert got.vectors.shape == (1, 384)
        assert 5.0 < proxy.deadlines[2] <= 7.05, "no timeout: the encoder's default is sent"


def test_unavailable_is_retried_and_triton_sees_every_attempt(
    minilm: TritonHandle, minilm_export: Path
) -> None:
    """Two UNAVAILABLE answers, then the real Triton: three attempts arrive, the third
    one's embedding is the model's."""
    with proxied(minilm, fail_first=2) as (address, proxy):
        got = asyncio.run(_proxied_encode(address, ["retry me"], 10.0, retries=3, backoff_s=0.01))
    assert proxy.attempts == 3
    assert_served(got.vectors, ["retry me"], minilm_export, default_model_dir())


def test_retries_stop_after_their_attempts_with_unavailable(minilm: TritonHandle) -> None:
    with proxied(minilm, fail_first=100) as (address, proxy):
        with pytest.raises(Unavailable, match="proxy: failure 3"):
            asyncio.run(_proxied_encode(address, ["x"], 10.0, retries=2, backoff_s=0.01))
    assert proxy.attempts == 3, "the first attempt and two retries, no more"


def test_unreachable_server_is_unavailable() -> None:
    port = free_port()  # nothing listens there

    async def go() -> None:
        with pytest.raises(Unavailable):
            await TritonEncoder.connect(
                TritonEncoderConfig(f"127.0.0.1:{port}", connect_timeout_s=2)
            )

    asyncio.run(go())


def test_connect_pins_the_newest_version_and_refuses_one_not_ready(minilm: TritonHandle) -> None:
    """An encoder that names no version is pinned to the newest ready one (sent on every
    infer, so a version published later does not change its vectors); a version that is
    not ready is Unavailable naming the ready ones."""

    async def pinned(enc: TritonEncoder) -> None:
        assert (enc.model_version, enc.cfg.model_version) == (1, "1")
        assert (await enc.encode(["pinned"], "query", timeout=10)).vectors.shape == (1, 384)

    asyncio.run(_with_encoder(minilm, pinned))
    with pytest.raises(Unavailable, match=r"version 2 of model 'embed' is not ready .*\[1\]"):
        asyncio.run(_with_encoder(minilm, pinned, model_version="2"))


def test_queries_run_in_this_process_from_the_version_triton_serves(minilm: TritonHandle) -> None:
    """``--query-repository``: a query's vector comes from this process (Triton answers
    no request for it) and equals Triton's; documents still go to Triton; the encoder is
    named as Triton's pinned version is (the query cache and generations key on it)."""
    from services.encoder.runtime.local_queries import PROBES, LocalQueries, with_local_queries

    texts = [f"{q} ({i})" for i in range(2) for q in SAMPLE_QUERIES]

    async def counted(n: int) -> None:
        """Until Triton's count of answered queries reaches ``n`` (it counts a request
        just after it answered; a CI run read the parity probe's 2 late)."""
        await await_until(lambda: _embed_counts(minilm)[0] >= n, f"Triton counts {n}", 10)

    async def go(enc: TritonEncoder) -> None:
        before, _ = _embed_counts(minilm)
        both = await with_local_queries(enc, minilm.config.model_repository, "embed")
        assert isinstance(both, LocalQueries)
        assert (both.model_version, both.digest) == (enc.model_version, enc.digest)
        assert enc.digest, "Triton reports the version's digest"
        answered = before + len(PROBES)  # the parity probe asked Triton these
        await counted(answered)
        here = await both.encode(texts, "query", timeout=20)
        assert _embed_counts(minilm)[0] == answered, "a query reached Triton"
        there = await enc.encode(texts, "query", timeout=20)
        assert min(row_cosines(here.vectors, there.vectors)) >= 0.999
        answered += len(texts)  # Triton's own answer to them, just above
        await counted(answered)
        docs = await both.encode(list(SAMPLE_DOCUMENTS[:2]), "document", timeout=20)
        await counted(answered + 2)
        assert _embed_counts(minilm)[0] == answered + 2, "documents go to Triton"
        assert docs.vectors.shape == (2, enc.dim)
        await both.local.close()  # the remote is the test's own, closed by _with_encoder

    asyncio.run(_with_encoder(minilm, go))


def test_a_version_this_process_cannot_vouch_for_keeps_triton(
    minilm: TritonHandle, tmp_path: Path
) -> None:
    """No readable repository, or one whose version's digest is not the one Triton
    reports: queries stay with Triton (the encoder comes back unwrapped)."""
    from services.encoder.runtime.local_queries import with_local_queries

    async def go(enc: TritonEncoder) -> None:
        assert await with_local_queries(enc, tmp_path / "nowhere", "embed") is enc
        enc.digest = "0" * 16  # as if Triton served another export from that folder
        assert await with_local_queries(enc, minilm.config.model_repository, "embed") is enc

    asyncio.run(_with_encoder(minilm, go))


def test_the_gateway_opens_the_query_graph_only_for_an_encoder_that_embeds_queries(
    minilm: TritonHandle,
) -> None:
    """``--query-repository``: a generation's encoder runs its queries here; the dual
    write's (documents only) is Triton's alone, with no graph opened or probed."""
    from services.encoder.runtime.local_queries import LocalQueries
    from services.gateway.encoders import build_encoder
    from services.gateway.settings import GatewaySettings

    settings = GatewaySettings(
        triton_url=minilm.grpc_url,
        query_repository=str(minilm.config.model_repository),
        auth=False,
    )

    async def go() -> None:
        generation = await build_encoder(settings, "embed", 1)
        documents = await build_encoder(settings, "embed", 1, queries=False)
        try:
            assert isinstance(generation, LocalQueries)
            assert isinstance(documents, TritonEncoder)
        finally:
            await generation.close()
            await documents.close()

    asyncio.run(go())
