"""The ``switch`` phase: wait (writes open, the replay going on) until the target's
replicas serve and applied the target's logs, close the source's writer gates, replay to
its final tails, wait until the target's replicas applied the target's tails, move the
alias (the target's tails as its ``switch_in``), open the target's gates, and hold every
write since the switch for a rollback (``rollback:<S>`` on the target's logs) until the
source is retired."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from services.common import positions
from services.common.errors import Unavailable
from services.generations import logs
from services.generations.context import RolloutContext
from services.generations.phase_catch_up import replay
from services.generations.registry import Generation
from services.generations.replicas import all_stats, parse_addresses
from services.index.changelog import text
from services.index.keys import CLOSED, CPU_PLACED_KEY


async def run_switch(ctx: RolloutContext) -> None:
    target, source = ctx.target(), ctx.source()
    tgt, src = ctx.keys(target), ctx.keys(source)
    if ctx.registry.alias().serving != target.name:
        await replicas_ready(ctx, target)
        await handed_over(ctx, target)
        await _switch_alias(ctx, target, source)
    ctx.registry.set_gates(tgt.layout, target.name)
    if tgt.layout != src.layout:
        ctx.registry.set_gates(src.layout, CLOSED)
    # Keep every write since the switch for `index rollback` (until S is retired).
    switch_in = {int(s): p for s, p in ctx.registry.get(target.name).switch_in.items()}
    logs.hold(ctx.client, tgt, switch_in, f"rollback:{source.name}", heartbeat=False)
    logs.release(ctx.client, src, f"rollout:{target.name}")
    # The holds on S's logs for a rollback from S (to its previous, or, after a
    # rollback, to T itself): S is the previous generation now, the only target left.
    for gen in ctx.registry.all():
        if gen.name != source.name:
            logs.release(ctx.client, src, f"rollback:{gen.name}")
    ctx.save(phase="done")


async def _switch_alias(ctx: RolloutContext, target: Generation, source: Generation) -> None:
    """Up to ``switch_attempts`` times: close S's gates, replay to S's final tails, and
    switch once T's replicas applied T's tails (else reopen S's gates and try again)."""
    tgt, src = ctx.keys(target), ctx.keys(source)
    for attempt in range(1, ctx.options.switch_attempts + 1):
        ctx.registry.set_state(target.name, "switching")
        ctx.registry.set_gates(src.layout, CLOSED)
        # Every write acknowledged from now on is refused (GenerationMoved; the gateway
        # retries it once the alias moved): S's logs end here.
        await replay(ctx, until=logs.tails(ctx.client, src))
        tails = logs.tails(ctx.client, tgt)
        if await target_applied(ctx, target, tails):
            ctx.save(phase="switch")  # still this builder's rollout (not aborted)
            added = {s: logs.entries_added(ctx.client, tgt.log(s)) for s in tails}
            ctx.registry.switch(target.name, tails)
            gen = ctx.registry.get(target.name)
            ctx.registry.put(replace(gen, params=dict(gen.params, switch_added=added)))
            return
        # T's replicas are behind: writes go on to S while they catch up.
        ctx.registry.set_gates(src.layout, source.name)
        ctx.progress.message(
            f"switch attempt {attempt}: {target.name}'s replicas did not apply "
            f"{target.name}'s logs within {ctx.options.shard_wait_s:.0f} s; writes "
            "resumed on the source"
        )
        ctx.registry.set_state(target.name, "catching_up")
    raise Unavailable(
        f"{target.name}'s shard replicas did not catch up in {ctx.options.switch_attempts} "
        "attempts (are they running? `index generations` shows their addresses); "
        "`index rollout` again resumes"
    )


async def handed_over(ctx: RolloutContext, target: Generation) -> None:
    """Wait, at most ``hand_over_s``, until no CPU budget holds T's processes: in the
    switch phase a local stack moves them to serving's CPUs, so that T's first searches
    do not share the budget's CPU with this builder's end. Nothing to wait for without a
    budget, or without a stack placing one (its record expires)."""
    deadline = time.monotonic() + ctx.options.hand_over_s
    while text(ctx.client.get(CPU_PLACED_KEY) or b"") == target.name:  # type: ignore[arg-type]
        if time.monotonic() > deadline:
            ctx.progress.message(
                f"{target.name}'s processes are still on the rollout's CPU budget after "
                f"{ctx.options.hand_over_s:.0f} s: switching anyway"
            )
            return
        await asyncio.sleep(0.05)


async def replicas_ready(ctx: RolloutContext, target: Generation) -> None:
    """Before the source's writes are closed: replay S's logs while T's replicas come up
    and apply what T's logs hold, for at most ``shard_wait_s``. A new generation's shard
    processes start once it is trained and take seconds to serve; a reshard reaches its
    switch sooner than that, and waited for with the writes closed, every write paused
    as long (2 s, test_generations_e2e's reshard). Not ready in time: the switch waits
    again with the writes closed, as before."""
    if not ctx.options.wait_for_shards:
        return
    # what T's logs hold now: a mark that stays put while the replay appends the writes
    # that go on (replicas always a step behind the newest tails would never be ready)
    mark = logs.tails(ctx.client, ctx.keys(target))
    deadline = time.monotonic() + ctx.options.shard_wait_s
    while time.monotonic() < deadline:
        if await _all_applied(ctx, target, mark):
            return
        await asyncio.sleep(0.2)
        await replay(ctx, until=None)  # the writes meanwhile: the closed replay stays short


async def target_applied(ctx: RolloutContext, target: Generation, tails: dict[int, str]) -> bool:
    """True once every replica of T's shards applied ``tails`` (or, without waiting for
    shards, at once)."""
    if not ctx.options.wait_for_shards:
        return True
    deadline = time.monotonic() + ctx.options.shard_wait_s
    while time.monotonic() < deadline:
        if await _all_applied(ctx, target, tails):
            return True
        await asyncio.sleep(0.2)
    return False


async def _all_applied(ctx: RolloutContext, target: Generation, tails: dict[int, str]) -> bool:
    """Whether every replica of T's shards (by their recorded addresses) applied ``tails``."""
    spec = ctx.registry.addresses(target.name)
    if not spec:
        return False
    applied = await _applied(ctx, spec)
    return len(applied) == len(tails) and all(
        replicas and all(p is not None and positions.at_least(p, tails[s]) for p in replicas)
        for s, replicas in enumerate(applied)
    )


async def _applied(ctx: RolloutContext, spec: str) -> list[list[str | None]]:
    if ctx.wiring.applied is not None:
        return await ctx.wiring.applied(spec)
    out: list[list[str | None]] = []
    shards = parse_addresses(spec)
    stats = await all_stats(spec, ctx.wiring.shard_tls)
    for addresses, replicas in zip(shards, stats, strict=True):
        for address, r in zip(addresses, replicas, strict=True):
            if isinstance(r, Unavailable):
                await ctx.check_transport(address)
        out.append([getattr(r, "applied", None) for r in replicas])
    return out
