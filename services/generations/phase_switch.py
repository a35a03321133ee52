"""The ``switch`` phase: wait (writes open, the replay going on) until the target's
replicas serve and applied the target's logs, close the source's writer gates, replay to
its final tails, wait until the target's replicas applied the target's tails, move the
alias (the target's tails as its ``switch_in``), open the target's gates, and hold every
write since the switch for a rollback (``rollback:<S>`` on the target's logs) until the
source is retired."""

from __future__ import annotations

from dataclasses import replace

from services.common.errors import Unavailable
from services.generations import logs
from services.generations.context import RolloutContext
from services.generations.phase_catch_up import replay
from services.generations.registry import Generation
from services.generations.stack_placed import handed_over
from services.generations.target_replicas import replicas_ready, target_applied
from services.index.keys import CLOSED


async def run_switch(ctx: RolloutContext) -> None:
    target, source = ctx.target(), ctx.source()
    tgt, src = ctx.keys(target), ctx.keys(source)
    if ctx.registry.alias().serving != target.name:
        await replicas_ready(ctx, target, lambda: replay(ctx, until=None))
        await handed_over(ctx, target.name)
        await _switch_alias(ctx, target, source)
    ctx.registry.set_gates(tgt.layout, target.name)
    if tgt.layout != src.layout:
        ctx.registry.set_gates(src.layout, CLOSED)
    # Keep every write since the switch for `index rollback` (until S is retired).
    switch_in = {int(s): p for s, p in ctx.registry.get(target.name).switch_in.items()}
    logs.hold(ctx.client, tgt, switch_in, f"rollback:{source.name}", heartbeat=False)
    logs.release(ctx.client, src, f"rollout:{target.name}")
    logs.drop_late_vectors(ctx.client, src, target.name)
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
