"""Triton's priority queue on a real tritonserver serving the generated CPU repository
with priority levels (``encoder repo --priority-levels 2``; off by default, see
RepositoryConfig.priority_levels): under a flood of the index builder's document encodes
(DOCUMENT_PRIORITY), a query encode (the default, QUERY_PRIORITY) waits for the batch
already running, not behind the queued documents (issue #24: search latency during a
rollout). Order of completions only, no timing. And without the levels (the default
repository) Triton ignores the priority the builder names."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.encoder.base import DOCUMENT_PRIORITY, PRIORITY_LEVELS
from services.encoder.build.repository import RepositoryConfig, generate_repository
from services.encoder.model import default_model_dir
from services.encoder.runtime.triton_client import TritonEncoder, TritonEncoderConfig
from services.encoder.serve.triton_server import TritonHandle, TritonServerConfig, run_triton
from tests.encoder_fixtures import SAMPLE_DOCUMENTS, encoder_base, ensure_onnx
from tests.support.processes import free_port

# texts per document encode = the model's max_batch: one request per batch. 16 long texts
# take ~2 s on one thread of a slow 2-vCPU VM: time enough for the query to arrive while
# the rest of the flood waits (64 made the test 52 s of CI)
BATCH = 16
FLOOD = 10  # document encodes queued at once


@pytest.fixture(scope="module")
def triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonHandle]:
    base = encoder_base(tmp_path_factory)
    onnx_path = ensure_onnx(default_model_dir(), base)
    repo = base / "repo-priority"
    config = RepositoryConfig(
        instances=1, intra_op_threads=1, max_batch=BATCH, priority_levels=PRIORITY_LEVELS
    )
    generate_repository(onnx_path, repo, config)
    cfg = TritonServerConfig(
        repo,
        grpc_port=free_port(),
        http_port=free_port(),
        metrics_port=free_port(),
        startup_timeout_s=90,
    )
    with run_triton(cfg, Path(base) / "triton-priority.log") as handle:
        yield handle


@pytest.mark.slow
def test_a_query_is_answered_before_queued_document_batches(triton: TritonHandle) -> None:
    long_doc = " ".join(SAMPLE_DOCUMENTS) * 2  # ~truncation length: a batch takes a while
    docs = [f"{n} {long_doc}" for n in range(BATCH)]

    async def run() -> tuple[list[str], int]:
        builder = await TritonEncoder.connect(
            TritonEncoderConfig(triton.grpc_url, priority=DOCUMENT_PRIORITY, default_timeout_s=600)
        )
        search = await TritonEncoder.connect(
            TritonEncoderConfig(triton.grpc_url, default_timeout_s=600)
        )
        order: list[str] = []
        first_done = asyncio.Event()

        async def document(n: int) -> None:
            await builder.encode(docs, "document")
            order.append(f"doc{n}")
            first_done.set()

        try:
            flood = [asyncio.create_task(document(n)) for n in range(FLOOD)]
            # Triton is running the flood and the rest of it is queued behind the batch
            await first_done.wait()
            queued = FLOOD - len(order)
            await search.encode(["what causes the common cold?"], "query")
            order.append("query")
            await asyncio.gather(*flood)
            return order, queued
        finally:
            await builder.close()
            await search.close()

    order, queued = asyncio.run(run())
    sent_after = order.index("query") - (FLOOD - queued)  # documents done after it was sent
    # It waited for the batch running when it arrived (and at most one that started while
    # it was on the wire), not for the queued ones: FIFO would put it behind all of them.
    assert queued >= 5, order
    assert sent_after <= 2, order
    assert len(order) - 1 - order.index("query") >= queued - 2, order


@pytest.mark.slow
def test_without_priority_levels_the_builders_priority_is_ignored(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The default repository has one queue; the builder still names DOCUMENT_PRIORITY
    (it cannot know the model's config), and Triton must serve it, not refuse it."""
    base = encoder_base(tmp_path_factory)
    repo = base / "repo-no-priority"
    generate_repository(ensure_onnx(default_model_dir(), base), repo, RepositoryConfig(instances=1))
    cfg = TritonServerConfig(
        repo, grpc_port=free_port(), http_port=free_port(), metrics_port=free_port()
    )

    async def run() -> tuple[int, ...]:
        builder = await TritonEncoder.connect(
            TritonEncoderConfig(handle.grpc_url, priority=DOCUMENT_PRIORITY, default_timeout_s=60)
        )
        try:
            out = await builder.encode(["a document", "another one"], "document")
            return tuple(out.vectors.shape)
        finally:
            await builder.close()

    with run_triton(cfg, Path(base) / "triton-no-priority.log") as handle:
        assert "priority_levels" not in (repo / "embed" / "config.pbtxt").read_text()
        assert asyncio.run(run()) == (2, 384)
