"""What every phase of a rollout works with: the options, the wiring, the store and the
current :class:`~services.generations.state.RolloutState` (docs/generations.md).

The phases (``phase_*.py``) are functions of a :class:`RolloutContext`; each reads the
state from ``ctx.state`` and moves it on with :meth:`RolloutContext.save`, which writes it
through the one :class:`~services.generations.state.RolloutStore`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from services.common.encoder_spec import EncoderSpec
from services.common.retrieval_setting import RetrievalSetting
from services.generations import logs
from services.generations.append import TargetAppender
from services.generations.encoding import Embedder, EncoderFactory
from services.generations.errors import TransportMismatch
from services.generations.pacing import DEFAULT_RATIO, Pacer
from services.generations.progress import Progress
from services.generations.registry import Generation, Registry
from services.generations.state import RolloutState, RolloutStore
from services.index.keys import GenerationKeys
from services.process.redis_client import SyncRedis
from services.rpc.tls import speaks_tls

if TYPE_CHECKING:
    from services.rpc.tls import ClientTLS

# publishes a checkpoint folder as a version of Triton's embed; blocking (the export and
# Triton's load take seconds), run in a thread
Publisher = Callable[[str, bool], EncoderSpec]  # (folder, int8_unmeasured)
Exporter = Callable[[str], AsyncIterator[tuple[list[str], np.ndarray, str]]]
AppliedProbe = Callable[[str], Awaitable[list[list[str | None]]]]


@dataclass(frozen=True)
class RolloutOptions:
    index_root: Path  # T's trained index goes to index_root / T's name
    batch: int = 64  # documents (or log entries) per batch; the progress is saved after each
    sample: int = 100_000  # training vectors at most (the first documents of the SCAN)
    # batches in flight (the next one's reads overlap this one's encode), and encode
    # calls in flight at most (ChunkSize.in_flight: as many as fit in encode_call_s)
    parallel: int = 2
    # texts per encode call at most (and the encoder's max_batch): Triton runs a query's
    # encode (higher priority) after the batch already running, so this bounds how long
    # a search waits behind the builder; smaller = less wait, more per-call overhead
    encode_batch: int = 16
    # seconds one encode call should take at most: the texts per call follow the encoder's
    # measured pace (services/generations/encoding.py ChunkSize), and the calls in flight
    # fit in it together, so that the gateways' dual encodes of new writes, queued on the
    # same Triton version, wait about this, inside their 1-s bound (measured: a tenth
    # still wait longer on 2 shared CPUs)
    encode_call_s: float = 0.25
    switch_lag: int = 256  # source log entries behind, at most, before the switch starts
    # source log entries the rollout may hold (not yet replayed) before it is aborted
    # (services/generations/held.py); 0: no bound. ~3-5 KB each in Redis at 384
    # dimensions with a 1,000-character text: 200,000 is about 1 GB
    max_held_entries: int = 200_000
    wait_for_shards: bool = True  # the switch waits for T's replicas to apply T's logs
    shard_wait_s: float = 300.0  # ...at most this long per attempt
    switch_attempts: int = 3
    # the switch waits this long at most for a local stack to move T's processes off a CPU
    # budget onto serving's CPUs (services/generations/placement.py "The hand-over")
    hand_over_s: float = 3.0
    stale_after_s: float = 15.0  # a rollout whose builder is silent this long is resumable
    heartbeat_s: float = 1.0
    target_recall: float | None = None  # None: the trainer's default
    encode_timeout_s: float = 60.0
    # the searches' p99 a rollout may cause, over the one before it (services/generations/
    # pacing.py: the re-embedding pauses to hold it); None: not paced. On by default since
    # the catch-up is bounded and the bulk stops at P0: with writes at 21/s on 2 shared
    # cores, paced rollouts read 1.40-2.50x the p99 before them (median 1.7), unpaced 2.33-2.59x
    # (docs/generations.md "Pacing on the searches' p99"), at 3-4x the rollout's time
    pace_ratio: float | None = DEFAULT_RATIO
    # the catch-up replays at most this many times the source's write rate (and at least
    # catch_up_floor entries/s): replayed flat out it was a rollout's worst window for the
    # searches (services/generations/phase_catch_up.py); None: flat out
    catch_up_factor: float | None = 4.0
    catch_up_floor: float = 50.0
    encode_retry_s: float = 300.0  # how long a failing encoder is retried before giving up


@dataclass(frozen=True)
class RolloutPlan:
    """What a rollout was asked for."""

    encoder: EncoderSpec | None = None  # None: the serving generation's encoder
    num_shards: int | None = None  # None: the serving generation's shard count
    retrain: bool = False  # reuse the vectors S's replicas hold (same encoder)
    encoder_dir: str = ""  # the checkpoint folder to publish (a resume names it again)
    # the target's retrieval setting (issue #35; None: none, the gateway's flags serve it)
    retrieval: RetrievalSetting | None = None
    # serve the new encoder's int8 graphs though no quality result holds for them
    # (``--int8-unmeasured``; recorded: a resume publishes the same way)
    int8_unmeasured: bool = False


@dataclass(frozen=True)
class Wiring:
    """How the builder reaches what is not Redis: the encoders, Triton's repository (the
    publish phase), the source's replicas' vectors (a retrain) and the target's replicas'
    positions (the switch); ``shard_tls`` None = plaintext."""

    encoders: EncoderFactory
    publisher: Publisher | None = None
    exporter: Exporter | None = None
    applied: AppliedProbe | None = None
    source_addresses: str | None = None  # g1's shards when `{gtr}:addrs` lacks them
    shard_tls: ClientTLS | None = None


@dataclass
class RolloutContext:
    """One running rollout: the state as last saved, and what the phases need."""

    client: SyncRedis
    registry: Registry
    store: RolloutStore
    options: RolloutOptions
    wiring: Wiring
    progress: Progress
    state: RolloutState
    probed: set[str] = field(default_factory=set)  # replicas whose transport was checked
    pacer: Pacer | None = None  # paces the re-embedding on the searches' p99 (None: not)
    # a CPU budget no local stack placed (services/generations/stack_placed.py): the next
    # phases do not wait for it again
    unplaced: bool = False
    _embedder: Embedder | None = None

    def save(self, **changes: Any) -> RolloutState:
        """Move the state on and record it (Takeover when another builder owns it)."""
        self.state = self.store.save(self.state.with_(**changes))
        return self.state

    def source(self) -> Generation:
        return self.registry.get(self.state.source)

    def target(self) -> Generation:
        return self.registry.get(self.state.target)

    def keys(self, gen: Generation) -> GenerationKeys:
        return self.registry.keys(gen)

    def appender(self, target: Generation) -> TargetAppender:
        tgt = self.keys(target)
        src = self.keys(self.source())
        return TargetAppender(self.client, tgt, copy_documents=tgt.layout != src.layout)

    def embedder(self, target: Generation) -> Embedder:
        if self._embedder is None:
            o = self.options
            self._embedder = Embedder(
                self.wiring.encoders,
                target.encoder,
                self.progress,
                encode_batch=o.encode_batch,
                parallel=o.parallel,
                timeout_s=o.encode_timeout_s,
                retry_s=o.encode_retry_s,
                call_s=o.encode_call_s,
                pacer=self.pacer,
            )
        return self._embedder

    async def close(self) -> None:
        if self._embedder is not None:
            await self._embedder.close()
            self._embedder = None

    def hold(self, keys: GenerationKeys, at: dict[int, str], name: str) -> None:
        logs.hold(self.client, keys, at, name)

    async def check_transport(self, address: str) -> None:
        """FailedPrecondition at once when the replica at ``address`` speaks TLS and the
        builder talks plaintext to it, or the other way round (gRPC says only "Socket
        closed", and waiting does not help); checked once per replica."""
        if address in self.probed:
            return

        tls = await asyncio.to_thread(speaks_tls, address)
        if tls is None:
            return  # not reachable (down, starting): the wait goes on
        self.probed.add(address)
        mine = self.wiring.shard_tls
        if tls and mine is None:
            raise TransportMismatch(
                f"shard replica {address} speaks TLS and the rollout reaches the replicas in "
                "plaintext",
                replica_tls=True,
            )
        if not tls and mine is not None:
            raise TransportMismatch(
                f"shard replica {address} speaks plaintext and the rollout reaches the "
                "replicas over TLS",
                replica_tls=False,
            )
