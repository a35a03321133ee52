"""The rollout builder: builds the next generation beside the serving one and switches to
it, resumable after a crash anywhere (docs/generations.md, "The rollout").

Phases, each recorded in ``{gtr}:rollout`` (:class:`~services.generations.state.RolloutState`,
``phase``) before it starts, with the progress it needs to resume (a SCAN cursor, per-shard
log positions) saved after every batch; each phase is a module of its own:

``publish``   (a new encoder's checkpoint) take the lock first, then publish the checkpoint
              as a version of Triton's ``embed``; a retire or an unpublish sees the lock
              during the publish (:func:`services.generations.encoders.generations_using`)
              (:mod:`.phase_publish`, with ``create`` and ``p0``)
``create``    take the lock, record the target T (``building``)
``p0``        record P0, the tails of the source S's logs; a *hold* keeps S's shards from
              trimming their logs past the replay position until the switch
``train``     a sample (the SCAN's first documents re-embedded, or with a retrain every
              vector S's replicas hold: :mod:`.retrain`), T's quantizer trained on it
              (:mod:`.phase_train`)
``bulk``      (new encoder) the rest of the SCAN: re-embed, append (:mod:`.phase_bulk`)
``catch_up``  replay S's logs from P0 until the lag is small (:mod:`.phase_catch_up`)
``switch``    close S's gates, replay to the end, wait for T's replicas, move the alias
              (:mod:`.phase_switch`)

Every append goes through :class:`~services.generations.append.TargetAppender`, so any
batch run twice appends nothing twice. A rollback is the same machine from ``catch_up``
(:mod:`.rollback`). The store is reached with a blocking client (bytes replies): the
builder is one process with nothing else to serve, and its Redis calls are short.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from services.common.errors import FailedPrecondition
from services.generations import logs, pacing, rollback, stack_placed
from services.generations.context import (
    AppliedProbe,
    Exporter,
    Publisher,
    RolloutContext,
    RolloutOptions,
    RolloutPlan,
    Wiring,
)
from services.generations.encoding import EncoderFactory, embedding_text
from services.generations.errors import NoModelRepository, PlanRefused, SourceAddressesUnknown
from services.generations.gpu_serving import refusal, source_keep
from services.generations.pacing import Pacer
from services.generations.phase_bulk import run_bulk
from services.generations.phase_catch_up import run_catch_up
from services.generations.phase_publish import record_target, run_create, run_p0, run_publish
from services.generations.phase_switch import run_switch
from services.generations.phase_train import run_train
from services.generations.progress import Progress
from services.generations.registry import Generation, Registry
from services.generations.replicas import parse_addresses
from services.generations.state import (
    DONE,
    PHASES,
    Mode,
    RecordedPlan,
    RolloutState,
    RolloutStore,
    Takeover,
)
from services.process import cpus as cpu_sets
from services.process.redis_client import SyncRedis

if TYPE_CHECKING:
    from services.rpc.tls import ClientTLS

__all__ = [
    "RolloutBuilder",
    "RolloutOptions",
    "RolloutPlan",
    "Takeover",
    "embedding_text",
]

Phase = Callable[[RolloutContext], Awaitable[None]]
STEPS: dict[str, Phase] = {
    "publish": run_publish,
    "create": run_create,
    "p0": run_p0,
    "train": run_train,
    "bulk": run_bulk,
    "catch_up": run_catch_up,
    "switch": run_switch,
}
assert tuple(STEPS) == PHASES


class RolloutBuilder:
    """Runs, resumes, aborts and rolls back rollouts (``client``: blocking Redis with bytes
    replies; ``encoders``: an encoder for a generation's encoder)."""

    def __init__(
        self,
        client: SyncRedis,
        encoders: EncoderFactory,
        options: RolloutOptions,
        progress: Progress | None = None,
        *,
        exporter: Exporter | None = None,
        applied: AppliedProbe | None = None,
        source_addresses: str | None = None,
        shard_tls: ClientTLS | None = None,
        publisher: Publisher | None = None,
    ) -> None:
        self.redis = client
        self.registry = Registry(client)
        self.store = RolloutStore(client)
        self.options = options
        self.progress = progress or Progress()
        self.wiring = Wiring(encoders, publisher, exporter, applied, source_addresses, shard_tls)
        self.owner = uuid.uuid4().hex
        self._probed: set[str] = set()

    # --- entry points -------------------------------------------------------------------

    async def rollout(self, plan: RolloutPlan) -> Generation:
        """Start a rollout, or resume the one recorded (when its builder is gone and
        ``plan`` asks for nothing else); the serving generation when done."""
        running = self.store.load()
        if running is not None:
            self.check_resumable(running, plan)
            return await self._resume(running, int8_unmeasured=plan.int8_unmeasured)
        serving = self.registry.serving()
        await self._check_plan(plan, serving)
        publish = plan.encoder is None and bool(plan.encoder_dir)
        num_shards = plan.num_shards or serving.num_shards
        encoder = plan.encoder or serving.encoder
        mode: Mode = "retrain" if plan.retrain else "encode"
        now = time.time()
        # With a checkpoint to publish the lock comes first and the publish is its first
        # phase: T's record, which needs the published version, is written at the
        # phase's end. The lock takes T's name with it: a refused rollout uses no number.
        state = RolloutState(
            target="",
            source=serving.name,
            mode=mode,
            phase="publish" if publish else "create",
            plan=RecordedPlan(
                None if publish else encoder,
                num_shards,
                plan.retrain,
                plan.encoder_dir,
                plan.retrieval,
                plan.int8_unmeasured,
            ),
            started_at=now,
            owner=self.owner,
            beat=now,
        )
        started = self.store.start(state.with_(host=rollback._host(), pid=rollback._pid()))
        if started is None:
            raise self.registry.busy()
        if not publish:
            root = self.options.index_root
            record_target(
                self.registry,
                root,
                started.target,
                serving.name,
                num_shards,
                encoder,
                mode,
                now,
                plan.retrieval,
            )
        return await self._resume(started)

    async def _check_plan(self, plan: RolloutPlan, serving: Generation) -> None:
        """InvalidArgument / FailedPrecondition for a plan that cannot run, before
        anything is recorded."""
        if plan.retrain and (plan.encoder is not None or plan.encoder_dir):
            raise PlanRefused(
                "reuses the serving encoder's vectors: no new encoder", option="retrain"
            )
        if plan.encoder is None and plan.encoder_dir and self.wiring.publisher is None:
            raise NoModelRepository("a new encoder: no Triton model repository to publish it into")
        num_shards = plan.num_shards or serving.num_shards
        if num_shards < 1:
            raise PlanRefused(f"{num_shards}: at least 1", option="shards")
        encoder = plan.encoder or serving.encoder
        if encoder.dim and serving.encoder.dim and plan.retrain and encoder != serving.encoder:
            raise PlanRefused("keeps the serving encoder", option="retrain")
        spec = self.registry.addresses(serving.name) or self.wiring.source_addresses
        if plan.retrain and not spec:
            raise SourceAddressesUnknown(
                f"a retrain reuses the vectors {serving.name}'s replicas hold, but their "
                "addresses are unknown ({gtr}:addrs names none)"
            )
        if plan.retrain:  # a TLS / plaintext mismatch refused before anything is recorded
            ctx = self._context(RolloutState(target=""))
            for address in (a for replicas in parse_addresses(spec or "") for a in replicas):
                await ctx.check_transport(address)
        # GPU shards that would serve from CPUs (a checkpoint to publish: at train, once
        # its dimension is known)
        dim = 0 if plan.encoder is None and plan.encoder_dir else encoder.dim
        if dim:
            keep = await source_keep(serving, spec, self.wiring.shard_tls, dim)
            if keep.problem:
                option = "retrain" if plan.retrain else "encoder"
                raise PlanRefused(refusal(keep, serving.name, dim), option=option)

    async def rollback(self) -> Generation:
        """Make the previous generation serve again (:mod:`services.generations.rollback`)."""
        running = self.store.load()
        if running is not None:
            self.check_resumable(running, RolloutPlan())
            if running.kind != "rollback":
                raise FailedPrecondition(
                    f"a rollout to {running.target} was interrupted: finish it with "
                    "`index rollout` or `index rollout --abort` first"
                )
            return await self._resume(running)
        return await self._resume(rollback.begin_rollback(self.redis, self.registry, self.owner))

    def abort(self) -> RolloutState:
        """Close the recorded rollout (:func:`services.generations.rollback.abort`); its
        state as it was."""
        running = self.store.load()
        if running is None:
            raise FailedPrecondition("no rollout is running")
        # Never under a live builder: it could switch the alias after the gates went back.
        self._wait_until_silent(running)
        rollback.abort(self.redis, self.registry, running)
        return running

    # --- resume -------------------------------------------------------------------------

    def check_resumable(self, running: RolloutState, plan: RolloutPlan) -> None:
        """FailedPrecondition unless the recorded rollout's builder is gone and ``plan``
        asks for nothing else. A builder on this host is gone when its pid is; one on
        another host (a Job's previous pod) when its heartbeat stops: this waits up to
        ``stale_after_s`` to see which."""
        self._wait_until_silent(running)
        asked = (
            plan.encoder is not None
            or plan.num_shards is not None
            or plan.retrain
            or bool(plan.encoder_dir)
            or plan.retrieval is not None
        )
        if asked and running.kind == "rollout":
            recorded = running.plan or RecordedPlan()
            same = (
                (plan.num_shards is None or plan.num_shards == recorded.shards)
                and plan.retrain == recorded.retrain
                and (plan.encoder is None or plan.encoder == recorded.encoder)
                and (not plan.encoder_dir or plan.encoder_dir == recorded.encoder_dir)
                and (plan.retrieval is None or plan.retrieval == recorded.retrieval)
            )
            if not same:
                raise FailedPrecondition(
                    f"a rollout to {running.target} was interrupted (phase "
                    f"{running.phase}) with other options: resume it with `index "
                    "rollout` (no options, or the same ones) or `index rollout --abort` first"
                )

    def _wait_until_silent(self, running: RolloutState) -> None:
        alive = FailedPrecondition(
            f"a rollout to {running.target} is running (phase {running.phase}, builder pid "
            f"{'' if running.pid is None else running.pid} on {running.host}): wait for "
            "it, or stop it and `index rollout --abort`"
        )
        if running.runs_here and running.pid is not None:
            if cpu_sets.running(running.pid):
                raise alive
            return
        first = running.beat
        deadline = time.monotonic() + self.options.stale_after_s + 2 * self.options.heartbeat_s
        while time.time() - first < self.options.stale_after_s:
            time.sleep(min(0.5, self.options.heartbeat_s))
            now = self.store.load()
            if now is None:
                raise FailedPrecondition(
                    f"the rollout to {running.target} ended meanwhile: see `index generations`"
                )
            if now.beat != first or time.monotonic() > deadline:
                raise alive

    def _context(self, state: RolloutState) -> RolloutContext:
        ratio = self.options.pace_ratio
        return RolloutContext(
            self.redis,
            self.registry,
            self.store,
            self.options,
            self.wiring,
            self.progress,
            state,
            probed=self._probed,
            pacer=None
            if ratio is None
            else Pacer(
                lambda: pacing.slowest_p99(self.redis),
                self.progress,
                ratio=ratio,
                read_baseline=lambda: pacing.slowest_baseline_p99(self.redis),
            ),
        )

    async def _resume(self, running: RolloutState, *, int8_unmeasured: bool = False) -> Generation:
        """Run ``running`` on from its phase; ``int8_unmeasured`` (the resume's
        ``--int8-unmeasured``) is added to its recorded plan (a plan that has it keeps it)."""
        ctx = self._context(self.store.claim(running, self.owner))
        recorded = ctx.state.plan
        if int8_unmeasured and recorded is not None and not recorded.int8_unmeasured:
            ctx.state = ctx.save(plan=replace(recorded, int8_unmeasured=True))
        if ctx.pacer is not None:  # the baseline, before this builder loads the machine
            await asyncio.to_thread(ctx.pacer.start)
        beat = asyncio.create_task(self._heartbeat(ctx))
        try:
            return await self._run(ctx)
        finally:
            beat.cancel()
            await ctx.close()
            if ctx.pacer is not None and ctx.pacer.figures.busy_s > 0:
                figures = ctx.pacer.figures.as_dict()
                self.progress.message(f"pacing summary {json.dumps(figures)}")

    async def _heartbeat(self, ctx: RolloutContext) -> None:
        while True:
            await asyncio.sleep(self.options.heartbeat_s)
            await asyncio.to_thread(self._beat, ctx)

    def _beat(self, ctx: RolloutContext) -> None:
        """Renew the heartbeat, and the holds on S's logs while they are in use."""
        if not self.store.beat(self.owner):
            return
        state = ctx.state
        if state.positions and state.phase in ("train", "bulk", "catch_up", "switch"):
            src = self.registry.keys(self.registry.get(state.source))
            logs.renew(self.redis, src, state.positions, f"rollout:{state.target}")

    async def _run(self, ctx: RolloutContext) -> Generation:
        while ctx.state.phase != DONE:
            phase = ctx.state.phase
            step = STEPS.get(phase)
            if step is None:
                raise FailedPrecondition(f"{{gtr}}:rollout has an unknown phase {phase!r}")
            self.progress.phase(phase)
            if ctx.pacer is not None:
                ctx.pacer.active = phase in pacing.PACED_PHASES
            await stack_placed.placed(ctx, phase)  # paused while searches run, from here
            await step(ctx)
        self.registry.end_rollout()
        return self.registry.serving()
