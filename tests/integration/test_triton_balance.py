"""The gateway's encoder over two real Triton servers (``--triton-url a,b`` or one
``dns:`` name): encodes are balanced over both, a server that appears in DNS gets
encodes once its model is ready, and when one is killed (-9, with its backend stubs)
every encode goes to the other without one failing.

Who answered is counted by each Triton itself (its ``/metrics``,
``nv_inference_request_success`` of the ``embed`` model), not by the client. The two
servers serve the tiny GTR-layout T5 repository and are shared by the module's tests,
in file order: the tests that count exact shares come before the SIGSTOP test (a CI run
once counted one encode more on a server after it), and the kill test runs last.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import signal
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Literal

import pytest

from services.encoder.base import Encoder
from services.encoder.build.repository import RepositoryConfig, generate_repository
from services.encoder.runtime.triton_client import TritonEncoder, TritonEncoderConfig
from services.encoder.serve.triton_server import TritonHandle, TritonServerConfig, run_triton
from services.rpc.balance import Balancing
from tests.encoder_fixtures import encoder_base, ensure_onnx, ensure_tiny_t5
from tests.support.dns import run_dns
from tests.support.processes import free_port, wait_for_port, wait_until
from tests.support.triton import inferences as served

HOSTS = ("127.0.0.2", "127.0.0.3")


@pytest.fixture(scope="module")
def tritons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[TritonHandle]]:
    base = encoder_base(tmp_path_factory)
    onnx_path = ensure_onnx(ensure_tiny_t5(base), base)
    repo = tmp_path_factory.mktemp("triton-balance") / "repo"
    generate_repository(onnx_path, repo, RepositoryConfig(instances=1, intra_op_threads=1))
    port = free_port()  # one gRPC port on two addresses: one DNS name can name both
    with (
        run_triton(_config(repo, HOSTS[0], port), repo.parent / "triton-a.log") as a,
        run_triton(_config(repo, HOSTS[1], port), repo.parent / "triton-b.log") as b,
    ):
        for handle in (a, b):  # ready models; the metrics endpoint may come a moment later
            wait_for_port(handle.config.metrics_port, 30, handle.config.host)
        yield [a, b]


def _config(repo: Path, host: str, port: int) -> TritonServerConfig:
    return TritonServerConfig(
        repo,
        grpc_port=port,
        http_port=free_port(),
        host=host,
        metrics_port=free_port(),
        startup_timeout_s=120,
    )


def _encoder_config(tritons: list[TritonHandle]) -> TritonEncoderConfig:
    return TritonEncoderConfig(
        ",".join(h.grpc_url for h in tritons),
        probe_every_s=0.2,
        balancing=Balancing("least_outstanding"),
    )


async def _load(
    encoder: Encoder,
    n: int | None,
    concurrency: int,
    timeout: float = 10,
    stop: asyncio.Event | None = None,
) -> list[BaseException]:
    """``n`` encodes (None: until ``stop`` is set) from ``concurrency`` closed-loop
    callers; the errors they got."""
    errors: list[BaseException] = []
    todo = itertools.count() if n is None else iter(range(n))

    async def caller() -> None:
        for i in todo:
            if stop is not None and stop.is_set():
                return
            try:
                await encoder.encode([f"query {i} about balancing"], "query", timeout=timeout)
            except Exception as exc:
                errors.append(exc)

    await asyncio.gather(*(caller() for _ in range(concurrency)))
    return errors


async def _settled(
    load: Awaitable[list[BaseException]], tritons: list[TritonHandle], n: int
) -> list[BaseException]:
    """Run ``load`` of ``n`` encodes and wait until the servers' metrics count them all
    (Triton counts a request just after it answered)."""
    before = sum(served(h) for h in tritons)
    errors = await load
    counted = lambda: sum(served(h) for h in tritons) - before >= n  # noqa: E731
    await asyncio.to_thread(wait_until, counted, f"Triton's metrics count {n} encodes", 10)
    return errors


def _in_turn(counts: list[int], n: int) -> bool:
    """Whether two servers' counts of ``n`` encodes sent in turn are half each, one
    encode run twice allowed: a CI run counted [11, 10] for 20 with no error (one encode
    sent again after its answer was lost, it seems; its Triton logs were gone)."""
    return n <= sum(counts) <= n + 1 and all(n // 2 <= c <= n // 2 + 1 for c in counts)


@pytest.mark.parametrize("mode", ["round_robin", "least_outstanding"])
def test_encodes_are_balanced_over_both_tritons(
    tritons: list[TritonHandle], mode: Literal["round_robin", "least_outstanding"]
) -> None:
    async def main() -> tuple[list[BaseException], list[int]]:
        cfg = dataclasses.replace(_encoder_config(tritons), balancing=Balancing(mode))
        encoder = await TritonEncoder.connect(cfg)
        try:
            # one at a time first (nothing outstanding: in turn), so that both servers
            # have warmed up before the load
            errors = await _settled(_load(encoder, 10, concurrency=1), tritons, 10)
            before = [served(h) for h in tritons]
            errors += await _settled(_load(encoder, 200, concurrency=4), tritons, 200)
            return errors, [served(h) - b for h, b in zip(tritons, before, strict=True)]
        finally:
            await encoder.close()

    errors, counts = asyncio.run(main())
    assert errors == []
    # one channel to one of them would give [200, 0]
    if mode == "round_robin":
        assert _in_turn(counts, 200), counts
    else:  # more to the one that answers faster: how much depends on the shared cores
        # (a CI run gave [188, 12]); that it follows the calls in flight is the test below
        assert 200 <= sum(counts) <= 201 and min(counts) >= 1, counts


def test_the_gateways_flags_give_its_encoder_both_tritons(tritons: list[TritonHandle]) -> None:
    from services.gateway.server import build_encoder
    from services.gateway.settings import GatewaySettings

    settings = GatewaySettings(
        shards="127.0.0.1:1",
        auth=False,
        triton_url=",".join(h.grpc_url for h in tritons),
        balance="round_robin",
    )

    async def main() -> tuple[list[BaseException], list[int]]:
        encoder = await build_encoder(settings)
        try:
            before = [served(h) for h in tritons]
            errors = await _settled(_load(encoder, 20, concurrency=1), tritons, 20)
            return errors, [served(h) - b for h, b in zip(tritons, before, strict=True)]
        finally:
            await encoder.close()

    errors, counts = asyncio.run(main())
    assert errors == []
    assert _in_turn(counts, 20), counts  # one channel to one of them: [20, 0]


def test_least_outstanding_sends_a_stalled_triton_no_more_than_it_holds(
    tritons: list[TritonHandle],
) -> None:
    """With one server SIGSTOPped, the encodes stuck on it count as in flight: the four
    callers leave two waiting there and send every other encode to the one that answers.
    In turn (round robin) every caller would soon wait on the stalled one, and the other
    would never count the encodes waited for below."""
    fast, stalled = tritons
    n, callers = 100, 4

    async def main() -> tuple[list[BaseException], int, int]:
        encoder = await TritonEncoder.connect(_encoder_config(tritons))
        try:
            await _settled(_load(encoder, 10, concurrency=1), tritons, 10)  # both warm
            start = [served(fast), served(stalled)]
            os.kill(stalled.process.pid, signal.SIGSTOP)  # the server; its metrics too
            try:
                # the encodes stuck on the stalled one wait for it: a deadline well past
                # the wait below, so that none of them may miss
                load = asyncio.ensure_future(_load(encoder, n, callers, timeout=120))
                enough = lambda: served(fast) - start[0] >= n - callers  # noqa: E731
                await asyncio.to_thread(wait_until, enough, "the other Triton's encodes", 60)
            finally:
                os.kill(stalled.process.pid, signal.SIGCONT)
            errors = await load
            await asyncio.to_thread(
                wait_until,
                lambda: sum(served(h) for h in tritons) - sum(start) >= n,
                f"Triton's metrics count {n} encodes",
                10,
            )
            return errors, served(fast) - start[0], served(stalled) - start[1]
        finally:
            await encoder.close()

    errors, to_fast, to_stalled = asyncio.run(main())
    assert errors == []
    assert to_fast + to_stalled == n
    assert 1 <= to_stalled <= callers // 2, (to_fast, to_stalled)


def test_a_triton_that_appears_in_dns_gets_encodes(tritons: list[TritonHandle]) -> None:
    first, second = tritons

    async def main(
        target: str, appear: Callable[[], None]
    ) -> tuple[list[BaseException], list[int]]:
        cfg = TritonEncoderConfig(  # in turn: how many the second gets is then exact
            target,
            probe_every_s=0.1,
            balancing=Balancing("round_robin", resolve_every_s=0.1),
        )
        encoder = await TritonEncoder.connect(cfg)
        try:
            start = served(second)
            errors = await _load(encoder, 40, concurrency=2)
            while_alone = served(second) - start
            appear()
            async with asyncio.timeout(30):  # resolved again, then its model is ready
                while len(encoder.pool.endpoints) < 2 or any(
                    s.suspect for s in encoder.pool.endpoints
                ):
                    await asyncio.sleep(0.05)
            start = served(second)
            errors += await _load(encoder, 100, concurrency=4)
            return errors, [while_alone, served(second) - start]
        finally:
            await encoder.close()

    with run_dns() as dns:
        dns.set("triton.test", [first.config.host])
        target = dns.target("triton.test", first.config.grpc_port)
        both = [h.config.host for h in tritons]
        errors, to_second = asyncio.run(main(target, lambda: dns.set("triton.test", both)))
    assert errors == []
    assert to_second[0] == 0  # the name named the first server only
    assert to_second[1] == 50  # of the 100 encodes after it named both


def test_with_one_triton_killed_every_encode_goes_to_the_other(
    tritons: list[TritonHandle],
) -> None:
    """Killed while encodes are in flight on it (checked in the same step as the kill):
    those fail over, and the callers, which keep calling until the survivor has answered
    100 more, see no error. The load runs until told to stop, so the wait for both to
    answer cannot outlast it however unevenly the shared cores split the encodes (a CI
    run with a fixed 400 gave the victim fewer than 20)."""
    victim, survivor = tritons

    async def main() -> tuple[list[BaseException], int, list[BaseException]]:
        encoder = await TritonEncoder.connect(_encoder_config(tritons))
        stop = asyncio.Event()
        try:
            (on_victim,) = [e for e in encoder.pool.endpoints if e.address == victim.grpc_url]
            start = [served(victim), served(survivor)]
            load = asyncio.ensure_future(_load(encoder, None, concurrency=4, stop=stop))
            both = lambda: served(victim) > start[0] and served(survivor) > start[1]  # noqa: E731
            await asyncio.to_thread(wait_until, both, "both Tritons answer under load", 60)
            async with asyncio.timeout(60):  # the kill in the step that saw one in flight
                while on_victim.outstanding == 0:  # nothing of ours on it this moment
                    await asyncio.sleep(0.001)
            os.killpg(victim.process.pid, signal.SIGKILL)  # the server and its stubs
            killed_at = served(survivor)
            more = lambda: served(survivor) >= killed_at + 100  # noqa: E731
            await asyncio.to_thread(wait_until, more, "100 encodes after the kill", 60)
            stop.set()
            during = await load
            after = served(survivor)
            errors = await _settled(_load(encoder, 100, concurrency=4), [survivor], 100)
            return during, served(survivor) - after, errors
        finally:
            stop.set()
            await encoder.close()

    during, to_survivor, after = asyncio.run(main())
    assert victim.process.wait(10) == -signal.SIGKILL
    assert during == [], during[:3]  # the encodes in flight on the victim failed over
    assert after == []
    # every one of the 100 on the survivor; Triton counts a request just after it answered,
    # so up to the 4 callers' last encodes of the load before may be counted after `after`
    # was read (a CI run saw 102)
    assert 100 <= to_survivor <= 100 + 4
