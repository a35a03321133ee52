"""The rollout's first phases: ``publish`` (a new encoder's checkpoint becomes a version of
Triton's ``embed``, under the lock), ``create`` (the target's record exists) and ``p0``
(the source's log tails, held, where the replay will start)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path

from services.common import positions
from services.common.encoder_spec import EncoderSpec
from services.common.errors import FailedPrecondition, NotFound
from services.common.retrieval_setting import RetrievalSetting
from services.generations import logs
from services.generations.context import RolloutContext
from services.generations.errors import NoModelRepository
from services.generations.registry import Generation, Registry
from services.generations.state import RecordedPlan


def record_target(
    registry: Registry,
    index_root: Path,
    name: str,
    source: str,
    num_shards: int,
    encoder: EncoderSpec,
    mode: str,
    now: float,
    retrieval: RetrievalSetting | None = None,
) -> None:
    """T's record, ``building``, its index under ``index_root``, with the retrieval
    setting the rollout was given (None: none)."""
    index_dir = str(Path(index_root).resolve() / name)
    registry.put(
        Generation(
            name,
            "building",
            num_shards,
            encoder,
            index_dir,
            {"trained": False, "source": source, "mode": mode},
            created_at=now,
            retrieval=retrieval,
        )
    )


async def run_publish(ctx: RolloutContext) -> None:
    """Publish the checkpoint under the lock taken (a resume publishes the same folder
    again, as the plan recorded: the version already there comes back), then record it
    in the plan and write T's record. A publish that fails (refused, Triton unreachable:
    the repository is put back as it was) ends the rollout: nothing else was recorded,
    so nothing is left to resume or abort."""
    state = ctx.state
    plan = state.plan or RecordedPlan()
    folder = plan.encoder_dir
    if not folder:
        raise FailedPrecondition("{gtr}:rollout is publishing, but its plan names no folder")
    publisher = ctx.wiring.publisher
    if publisher is None:
        raise NoModelRepository(
            f"the rollout to {state.target} stopped while publishing {folder}: resuming it "
            "needs Triton's model repository, or an abort"
        )
    try:
        spec = await asyncio.to_thread(publisher, folder, plan.int8_unmeasured)
    except Exception:  # refused, or failed in the export (torch, a full disk, ...)
        if ctx.store.owner() == state.owner:
            ctx.store.end()  # the lock was all there was
        raise
    # T's record first: a crash before the phase moves publishes again (the same
    # version) and writes the same record
    record_target(
        ctx.registry,
        ctx.options.index_root,
        state.target,
        state.source,
        plan.shards,
        spec,
        state.mode,
        state.started_at or time.time(),
        plan.retrieval,
    )
    ctx.save(
        plan=replace(plan, encoder=spec),
        phase="create",
    )


async def run_create(ctx: RolloutContext) -> None:
    """The record is written right after the lock; a crash between the two leaves none."""
    try:
        ctx.target()
    except NotFound:
        raise FailedPrecondition(
            f"the rollout to {ctx.state.target} stopped before recording it: abort it, then "
            "start again"
        ) from None
    ctx.save(phase="p0")


async def run_p0(ctx: RolloutContext) -> None:
    """Record P0, the source's log tails, and hold the logs there."""
    src = ctx.keys(ctx.source())
    name = f"rollout:{ctx.state.target}"
    # Hold S's logs from 0-0 first (no trim passes it), then at P0: no write between
    # reading the tails and registering the hold can be trimmed away.
    ctx.hold(src, {s: positions.ZERO for s in range(src.num_shards)}, name)
    p0 = logs.tails(ctx.client, src)
    added = {s: logs.entries_added(ctx.client, src.log(s)) for s in range(src.num_shards)}
    ctx.hold(src, p0, name)
    ctx.save(p0=p0, positions=dict(p0), replayed={s: 0 for s in p0}, added0=added, phase="train")
