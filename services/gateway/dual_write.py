"""The dual write: while a rollout builds a generation with another encoder, every upsert
is encoded with that encoder too and its log entry carries those vectors beside its own
(``tenc``, ``tdim``, ``tvecs``: :class:`services.index.changelog.TargetVectors`), so the
rollout's catch-up appends them instead of encoding every write again (docs/generations.md,
"Catch-up under writes"). Without it a rollout to a new encoder could only finish when the
builder out-encoded the writers.

How the gateway learns of it: :class:`~services.gateway.generations.GenerationSource`
already reads the running rollout's target and its record on each background refresh
(every ``--alias-refresh-ms``, to prepare the target for its switch) and hands both
records to :meth:`DualWrites.update`: no Redis read per write. It is on while the target
is ``building``, ``catching_up`` or ``switching`` and its encoder's identity
(``EncoderSpec.identity()``) is not the serving generation's; it is off once the rollout
ends (switch, abort) or the alias names the target, and a write asks for the dual
encoder of the generation it writes to only (:meth:`DualWrites.current`), so a write
retried into the new generation after a switch takes none.

Switching it off never cuts a dual encode in flight: each one holds its target
(:meth:`DualWrites.lease`), and the target's encoder is closed after the last of them
ends. (It was closed at once, and closing a Triton client cancels its calls in flight: the
write's handler ended cancelled, gRPC sent its caller nothing, and the caller's upsert
ran into its own deadline, test_generations_e2e at a switch.)

What a late one costs: the write waits for the second encode
:data:`DUAL_ENCODE_TIMEOUT_S` at most (and never past its deadline); a later one does not
hold the write, which is logged without the target's vectors and acknowledged as always,
never failed for the rollout's sake. The encode goes on (:meth:`DualWrites.start`, within
:data:`LATE_ENCODE_S`, :data:`MAX_LATE` of them at once) and its rows are kept beside the
log entry once it ends (:meth:`DualWrites.keep_late`,
:mod:`services.index.client.late_vectors`), where the catch-up finds them: the target's
encoder does the work once, not once here and once more in the catch-up. Only an encode
that fails (or one past :data:`MAX_LATE`, or a gateway gone meanwhile) leaves the entry to
the catch-up's re-embedding. No acknowledged write depends on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

from services.common.errors import RetrievalError
from services.gateway.ports import Encoder
from services.generations.registry import Generation

log = logging.getLogger(__name__)

T = TypeVar("T")

# The write waits this long at most for its second encode (and never past its deadline);
# a later one goes on without the write and its rows are kept beside the entry
DUAL_ENCODE_TIMEOUT_S = 1.0
# ... within this (from its start): a later one leaves the entry to the catch-up
LATE_ENCODE_S = 10.0
# Late encodes a gateway waits on at most; one more is cancelled at its bound (failed).
# Triton queues them in arrival order with the builder's calls (one queue by default):
# while its encoder cannot keep up with the writes, an unbounded number of late encodes
# would hold the builder back by up to LATE_ENCODE_S and then fail anyway.
MAX_LATE = 32
# A rollout target in one of these states takes the dual write.
DUAL_STATES = ("building", "catching_up", "switching")

# (the generation's encoder, whether the caller owns it): the gateway's GenerationParts.encoder
EncoderFactory = Callable[[Generation], Awaitable[tuple[Encoder, bool]]]


@dataclass(eq=False)
class DualTarget:
    """Upserts to ``source`` are encoded for ``target`` too, with ``encoder``."""

    source: str
    target: str
    identity: str  # the target's EncoderSpec.identity(), logged as the entry's ``tenc``
    encoder: Encoder
    owned: bool
    users: int = field(default=0, compare=False)  # dual encodes in flight
    stopped: bool = field(default=False, compare=False)  # off: closed after its last user


def wanted(serving: Generation | None, target: Generation | None) -> bool:
    """Whether upserts to ``serving`` need ``target``'s vectors too: a rollout's target in
    a building state whose encoder is another one."""
    return (
        serving is not None
        and target is not None
        and target.name != serving.name
        and target.state in DUAL_STATES
        and target.encoder.identity() != serving.encoder.identity()
    )


class DualWrites:
    """The dual write's one target (or none), as the source's last refresh decided."""

    def __init__(self, encoders: EncoderFactory | None) -> None:
        self._encoders = encoders
        self._current: DualTarget | None = None
        self._closing: set[asyncio.Task[None]] = set()
        self._late: set[asyncio.Task[None]] = set()  # keepers of late encodes

    @contextlib.contextmanager
    def lease(self, dual: DualTarget) -> Iterator[Encoder]:
        """``dual``'s encoder for one dual encode: switched off meanwhile, it is closed
        only after the last encode holding it ends."""
        dual.users += 1
        try:
            yield dual.encoder
        finally:
            dual.users -= 1
            if dual.stopped and dual.users == 0:
                self._close_later(dual)

    def start(self, dual: DualTarget, encode: Callable[[Encoder], Awaitable[T]]) -> asyncio.Task[T]:
        """``encode`` with ``dual``'s encoder as a task of its own, the encoder leased
        (:meth:`lease`) until it ends: the write waits for it within its bound, and a late
        one goes on (:meth:`keep_late`)."""

        async def run() -> T:
            with self.lease(dual) as encoder:
                return await encode(encoder)

        return asyncio.get_running_loop().create_task(run())

    def late_full(self) -> bool:
        """Whether :data:`MAX_LATE` late encodes are kept waiting on already."""
        return len(self._late) >= MAX_LATE

    def keep_late(
        self,
        encode: asyncio.Task[T],
        keep: Callable[[T], Awaitable[None]],
        outcome: Callable[[str], None],
    ) -> None:
        """After the write logged without them: ``keep`` the late ``encode``'s result when
        it ends (``outcome`` "late"), or ``outcome`` "failed" when it or ``keep`` fails.
        Cancelled when the gateway closes."""

        async def run() -> None:
            try:
                await keep(await encode)
            except asyncio.CancelledError:
                me = asyncio.current_task()
                if me is None or me.cancelling():  # the gateway closing
                    raise
                outcome("failed")  # the encode cancelled under it (its client closed)
                return
            except Exception as exc:  # a task of its own: nobody else would see it
                outcome("failed")
                level = (
                    logging.INFO
                    if isinstance(exc, RetrievalError | TimeoutError)
                    else logging.WARNING
                )
                log.log(level, "dual write: a late encode of the rollout target failed (%r)", exc)
                return
            outcome("late")

        def ended(task: asyncio.Task[None]) -> None:
            self._late.discard(task)
            encode.cancel()  # the keeper cancelled first (close): the encode too

        task = asyncio.get_running_loop().create_task(run())
        self._late.add(task)
        task.add_done_callback(ended)

    def current(self, serving: str) -> DualTarget | None:
        """The dual target of upserts written to ``serving`` now (None: no dual write)."""
        dual = self._current
        return dual if dual is not None and dual.source == serving else None

    async def update(self, serving: Generation | None, target: Generation | None) -> None:
        """On when :func:`wanted`, with ``target``'s encoder (built once; one that cannot
        be built yet, e.g. its Triton version still loading, is tried at the next
        refresh); off otherwise."""
        if self._encoders is None:
            return
        if not wanted(serving, target):
            await self._stop()
            return
        assert serving is not None and target is not None
        identity = target.encoder.identity()
        dual = self._current
        if dual is not None and (dual.source, dual.target, dual.identity) == (
            serving.name,
            target.name,
            identity,
        ):
            return
        await self._stop()
        try:
            encoder, owned = await self._encoders(target)
        except RetrievalError as exc:
            log.info("dual write for %s not on yet (its encoder: %s)", target.name, exc)
            return
        self._current = DualTarget(serving.name, target.name, identity, encoder, owned)
        log.info(
            "dual write on: upserts to %s are encoded for %s too (%s)",
            serving.name,
            target.name,
            identity,
        )

    async def _stop(self) -> None:
        dual, self._current = self._current, None
        if dual is None:
            return
        log.info("dual write off (%s's rollout to %s)", dual.source, dual.target)
        dual.stopped = True
        if dual.users == 0:
            await self._close(dual)

    def _close_later(self, dual: DualTarget) -> None:
        task = asyncio.get_running_loop().create_task(self._close(dual))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    @staticmethod
    async def _close(dual: DualTarget) -> None:
        if not dual.owned:
            return
        try:
            await dual.encoder.close()
        except Exception:  # closing must not stop the refresh
            log.exception("closing the dual write's encoder of %s", dual.target)

    async def close(self) -> None:
        late = list(self._late)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        await self._stop()
        if self._closing:
            await asyncio.gather(*list(self._closing), return_exceptions=True)
