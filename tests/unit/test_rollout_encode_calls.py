"""The builder's encode calls are cut by time (services/generations/encoding.py ChunkSize):
a dual encode of a new write, queued on the same Triton version behind the builder's
calls, waits well inside its 1-s bound (``DUAL_ENCODE_TIMEOUT_S``).

The encoder here is one FIFO instance on a virtual clock (a call advances it by its
texts × the seconds per text), as a Triton version with one instance runs its requests:
the policy is what is under test, not a model's speed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import numpy as np
import pytest

from services.common.encoder_spec import EncoderSpec
from services.common.errors import InvalidArgument, Unavailable
from services.encoder.base import Embeddings, Encoder
from services.encoder.profiles import Kind
from services.gateway.dual_write import DUAL_ENCODE_TIMEOUT_S
from services.generations.encoding import ChunkSize, Embedder
from services.generations.pacing import Pacer
from services.generations.progress import Progress

PER_TEXT_S = 0.086  # a 1,000-character document on one CPU (bench.rollout's in-process pace)


class OneInstance(Encoder):
    """FIFO, one call at a time, on a virtual clock."""

    model_name = "virtual"
    dim = 4
    max_batch = 64

    def __init__(self, per_text_s: float = PER_TEXT_S) -> None:
        self.per_text_s = per_text_s
        self.now = 0.0
        self.calls: list[int] = []
        self.queued = 0  # calls sent and not answered yet
        self._queue = asyncio.Lock()

    async def encode(
        self, texts: Sequence[str], kind: Kind, timeout: float | None = None
    ) -> Embeddings:
        self.queued += 1
        async with self._queue:
            await asyncio.sleep(0)  # the others queue meanwhile
            self.now += self.per_text_s * len(texts)
            self.calls.append(len(texts))
        self.queued -= 1
        rows = np.array([[float(t.split()[-1]), 0, 0, 1] for t in texts], np.float32)
        return Embeddings(rows, [False] * len(texts))

    async def close(self) -> None:
        pass


class Faulty(OneInstance):
    """Attempt ``n`` (from 1) raises ``fault(n)`` when that is not None, after
    ``lost_s`` virtual seconds (a timeout waited out); the others answer."""

    def __init__(self, fault: Callable[[int], Exception | None], lost_s: float = 0.0) -> None:
        super().__init__()
        self.fault, self.lost_s = fault, lost_s
        self.attempts = 0

    async def encode(
        self, texts: Sequence[str], kind: Kind, timeout: float | None = None
    ) -> Embeddings:
        self.attempts += 1
        error = self.fault(self.attempts)
        if error is not None:
            self.now += self.lost_s
            raise error
        return await super().encode(texts, kind, timeout)


def embedder(encoder: OneInstance, call_s: float, encode_batch: int = 16) -> Embedder:
    async def factory(spec: EncoderSpec) -> Encoder:
        return encoder

    return Embedder(
        factory,
        EncoderSpec("virtual", 1, 4),
        Progress(),
        encode_batch=encode_batch,
        parallel=2,
        timeout_s=60.0,
        retry_s=1.0,
        call_s=call_s,
        clock=lambda: encoder.now,
    )


async def dual_encode_wait(call_s: float) -> tuple[float, list[int], np.ndarray]:
    """The builder embeds 200 documents; once it is under way a write's dual encode joins
    the queue: how long it waited (virtual seconds), the builder's call sizes, its rows."""
    encoder = OneInstance()
    builder = embedder(encoder, call_s)
    texts = [f"doc {i}" for i in range(200)]
    bulk = asyncio.ensure_future(builder.embed(texts))
    # past the probe (the builder's calls are full size), and behind the builder's calls
    while len(encoder.calls) < 6 or not encoder.queued:
        await asyncio.sleep(0)
    sent = encoder.now
    await encoder.encode(["write 0"], "document")
    waited = encoder.now - sent
    return waited, encoder.calls, await bulk


def test_a_dual_encode_waits_within_its_bound_behind_time_cut_calls() -> None:
    waited, calls, rows = asyncio.run(dual_encode_wait(call_s=0.25))
    assert waited < DUAL_ENCODE_TIMEOUT_S / 2, (waited, calls)
    assert max(calls[1:]) <= 3, calls  # 0.25 s at 0.086 s a text: 2 texts a call
    assert rows[:, 0].tolist() == list(range(200))  # every row, in order


def test_calls_cut_by_count_alone_made_it_wait_past_its_bound() -> None:
    """The same with no time bound (16 texts a call, as before): the dual encode waits
    behind two calls of ~1.4 s and its gateway gives up on it."""
    waited, calls, _ = asyncio.run(dual_encode_wait(call_s=1e9))
    assert max(calls) == 16
    assert waited > DUAL_ENCODE_TIMEOUT_S, (waited, calls)


def test_the_call_size_follows_the_pace_and_stays_within_its_bounds() -> None:
    chunks = ChunkSize(most=16, call_s=0.25)
    assert chunks.next() == 2  # the probe
    chunks.observe(2, 0.2)  # 0.1 s a text
    assert chunks.next() == 2
    for _ in range(30):
        chunks.observe(10, 0.05)  # fast: 5 ms a text
    assert chunks.next() == 16  # capped by encode_batch
    for _ in range(30):
        chunks.observe(1, 2.0)  # slow: never below one text
    assert chunks.next() == 1
    chunks.observe(0, 5.0)  # an empty call teaches nothing
    assert chunks.next() == 1


@pytest.mark.parametrize("call_s", [0.25, 1e9])
def test_a_failed_call_fails_the_batch_and_sends_no_more(call_s: float) -> None:
    encoder = Faulty(lambda attempt: InvalidArgument("a bad text") if attempt >= 3 else None)
    with pytest.raises(InvalidArgument, match="a bad text"):
        asyncio.run(embedder(encoder, call_s).embed([f"doc {i}" for i in range(200)]))
    # the failure stops the sending: at most a call already in flight beside it
    # follows, of the 100 calls of 2 (or 13 of 16) the batch would take
    assert encoder.attempts <= 4, encoder.attempts


class Counting(OneInstance):
    inside = 0
    most = 0

    async def encode(
        self, texts: Sequence[str], kind: Kind, timeout: float | None = None
    ) -> Embeddings:
        self.inside += 1
        self.most = max(self.most, self.inside)
        try:
            return await super().encode(texts, kind, timeout)
        finally:
            self.inside -= 1


def two_batches(encoder: Counting) -> tuple[np.ndarray, np.ndarray]:
    """The bulk phase's two batches in flight, embedded at once by one embedder."""

    async def both() -> tuple[np.ndarray, np.ndarray]:
        builder = embedder(encoder, call_s=0.25)
        first = [f"doc {i}" for i in range(40)]
        second = [f"doc {i}" for i in range(40, 80)]
        a, b = await asyncio.gather(builder.embed(first), builder.embed(second))
        return a, b

    a, b = asyncio.run(both())
    assert a[:, 0].tolist() == list(range(40)) and b[:, 0].tolist() == list(range(40, 80))
    return a, b


def test_calls_cut_by_time_go_one_at_a_time_over_concurrent_batches() -> None:
    """Calls of ~0.25 s (a CPU encoder): one in the encoder's queue at a time, over both
    batches (two each, as before, put up to four ahead of a dual encode; two, as
    after that, still failed a quarter of the dual encodes in bench.rollout)."""
    encoder = Counting()
    two_batches(encoder)
    assert encoder.most == 1, encoder.most


def test_short_calls_cut_by_count_keep_two_in_flight() -> None:
    """Calls capped at 16 texts that take 16 ms (a GPU): two in flight, so the encoder
    never waits for the next request between them, and a dual encode still waits
    ~32 ms."""
    encoder = Counting(per_text_s=0.001)
    two_batches(encoder)
    assert encoder.most == 2, encoder.most


def test_the_calls_in_flight_follow_the_call_time() -> None:
    chunks = ChunkSize(most=16, call_s=0.25)
    assert chunks.in_flight(2) == 1  # nothing timed yet
    chunks.observe(16, 0.02)
    assert chunks.in_flight(2) == 2  # short calls: up to the cap
    assert chunks.in_flight(8) == 8
    for _ in range(30):
        chunks.observe(3, 0.25)
    assert chunks.in_flight(2) == 1


def test_an_outage_before_a_call_answers_is_not_its_pace() -> None:
    """A call that failed for 30 s (Triton restarting) and then answered: the call size
    and the pacer learn the answering attempt's seconds, not the outage's. Counted, the
    outage made the pace 30 s a call: calls of one text, and at the pacer's lowest duty
    (0.1) a pause of nine times the outage."""

    # the first attempt waits out its timeout, then fails
    encoder = Faulty(
        lambda attempt: Unavailable("triton: connection refused") if attempt == 1 else None,
        lost_s=30.0,
    )
    builder = embedder(encoder, call_s=0.25)
    pauses: list[float] = []

    async def pause(seconds: float) -> None:
        pauses.append(seconds)

    builder.pacer = Pacer(lambda: None, Progress(), clock=lambda: encoder.now, sleep=pause)
    builder.pacer.duty = 0.1  # the lowest duty, as in bench.rollout's bulk

    rows = asyncio.run(builder.embed([f"doc {i}" for i in range(2)]))
    assert rows[:, 0].tolist() == [0.0, 1.0]
    assert encoder.attempts == 2
    assert builder._chunks is not None and builder._chunks.per_text_s == pytest.approx(PER_TEXT_S)
    assert builder.pacer.figures.busy_s == pytest.approx(2 * PER_TEXT_S)
    assert pauses == [pytest.approx(2 * PER_TEXT_S * 9)]
