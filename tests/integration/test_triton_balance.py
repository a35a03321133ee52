"""The gateway's encoder over two real Triton servers (``--triton-url a,b``): encodes are
balanced over both, and when one is killed (-9, with its backend stubs) every encode
goes to the other without one failing.

Who answered is counted by each Triton itself (its ``/metrics``,
``nv_inference_request_success`` of the ``embed`` model), not by the client. The two
servers serve the tiny GTR-layout T5 repository and are shared by the module's tests;
the kill test runs last.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.common.balance import Balancing
from services.encoder.build.repository import RepositoryConfig, generate_repository
from services.encoder.runtime.triton_client import TritonEncoder, TritonEncoderConfig
from services.encoder.serve.triton_server import TritonHandle, TritonServerConfig, run_triton
from tests.encoder_fixtures import encoder_base, ensure_onnx, ensure_tiny_t5
from tests.support.processes import free_port, wait_until
from tests.support.triton import inferences as served


@pytest.fixture(scope="module")
def tritons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[TritonHandle]]:
    base = encoder_base(tmp_path_factory)
    onnx_path = ensure_onnx(ensure_tiny_t5(base), base)
    repo = tmp_path_factory.mktemp("triton-balance") / "repo"
    generate_repository(onnx_path, repo, RepositoryConfig(instances=1, intra_op_threads=1))
    with (
        run_triton(_config(repo), repo.parent / "triton-a.log") as a,
        run_triton(_config(repo), repo.parent / "triton-b.log") as b,
    ):
        yield [a, b]


def _config(repo: Path) -> TritonServerConfig:
    return TritonServerConfig(repo, grpc_port=free_port(), http_port=free_port(),
                              metrics_port=free_port(), startup_timeout_s=120)  # fmt: skip


def _encoder_config(tritons: list[TritonHandle]) -> TritonEncoderConfig:
    return TritonEncoderConfig(
        ",".join(h.grpc_url for h in tritons),
        probe_every_s=0.2,
        balancing=Balancing("least_outstanding"),
    )


async def _load(encoder: TritonEncoder, n: int, concurrency: int) -> list[BaseException]:
    """``n`` encodes from ``concurrency`` closed-loop callers; the errors they got."""
    errors: list[BaseException] = []
    todo = iter(range(n))

    async def caller() -> None:
        for i in todo:
            try:
                await encoder.encode([f"query {i} about balancing"], "query", timeout=10)
            except Exception as exc:
                errors.append(exc)

    await asyncio.gather(*(caller() for _ in range(concurrency)))
    return errors


def test_encodes_are_balanced_over_both_tritons(tritons: list[TritonHandle]) -> None:
    before = [served(h) for h in tritons]

    async def main() -> list[BaseException]:
        encoder = await TritonEncoder.connect(_encoder_config(tritons))
        try:
            return await _load(encoder, 200, concurrency=4)
        finally:
            await encoder.close()

    assert asyncio.run(main()) == []
    counts = [served(h) - b for h, b in zip(tritons, before, strict=True)]
    assert sum(counts) == 200, counts
    # one channel to one of them would give [200, 0]; least-outstanding splits the load
    assert min(counts) >= 50, counts


def test_with_one_triton_killed_every_encode_goes_to_the_other(
    tritons: list[TritonHandle],
) -> None:
    victim, survivor = tritons

    async def main() -> tuple[list[BaseException], int, list[BaseException]]:
        encoder = await TritonEncoder.connect(_encoder_config(tritons))
        try:
            start = [served(victim), served(survivor)]
            load = asyncio.ensure_future(_load(encoder, 400, concurrency=4))
            both = lambda: served(victim) >= start[0] + 20 and served(survivor) >= start[1] + 20  # noqa: E731
            await asyncio.to_thread(wait_until, both, "both Tritons answer under load", 30)
            os.killpg(victim.process.pid, signal.SIGKILL)  # the server and its stubs
            during = await load
            after = served(survivor)
            errors = await _load(encoder, 100, concurrency=4)
            return during, served(survivor) - after, errors
        finally:
            await encoder.close()

    during, to_survivor, after = asyncio.run(main())
    assert victim.process.wait(10) == -signal.SIGKILL
    assert during == [], during[:3]  # the encodes in flight on the victim failed over
    assert after == []
    assert to_survivor == 100
