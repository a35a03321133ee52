"""The builder's side of a local stack's placement record
(:data:`~services.index.keys.CPU_PLACED_KEY`: which generation a CPU budget holds, written
by each pass of the stack's generations poller while a budget is recorded;
:mod:`services.generations.placement`). Two waits:

- :func:`placed`, before each phase the budget holds: until the stack holds T's processes
  and this builder (pinned to the budget, and listed for the gateway's pause while
  searches run, :mod:`services.process.hold`), so that a phase's work never runs
  unpaused while the stack's next pass is still to come. Without it a retrain's training
  began up to a poller pass (0.5 s) before the pause: 250-350 ms stalls of every search
  in flight at a rollout's start (docs/generations.md "A rollout pauses while searches
  run");
- :func:`handed_over`, in the switch: until no budget holds T's processes any more.

Nothing to wait for without a budget; without a stack placing one the record never
appears and :func:`placed` gives up after :data:`NO_STACK_S`, once per rollout run.
"""

from __future__ import annotations

import asyncio
import time

from services.generations.context import RolloutContext
from services.generations.placement import HANDED_OVER
from services.index.changelog import text
from services.index.keys import CPU_BUDGET_KEY, CPU_PLACED_KEY

POLL_S = 0.05
# A stack places a recorded budget on its next poller pass (every 0.5 s): no record after
# this long, no stack places it (a rollout run against a store no local stack serves).
NO_STACK_S = 1.5


def _placed_now(ctx: RolloutContext) -> str | None:
    raw = ctx.client.get(CPU_PLACED_KEY)
    return None if raw is None else text(raw)


async def placed(ctx: RolloutContext, phase: str) -> None:
    """Before ``phase``: with a CPU budget recorded and T's processes not yet handed over
    (:data:`~services.generations.placement.HANDED_OVER`), wait until the stack's record
    names T, at most ``hand_over_s`` (:data:`NO_STACK_S` while there is no record, after
    which the builder's next phases do not wait: no stack places its budget)."""
    target = ctx.state.target
    if not target or phase in HANDED_OVER or ctx.unplaced:
        return
    if not ctx.client.exists(CPU_BUDGET_KEY):
        return
    started = time.monotonic()
    while (now := _placed_now(ctx)) != target:
        waited = time.monotonic() - started
        if waited > ctx.options.hand_over_s or (now is None and waited > NO_STACK_S):
            ctx.unplaced = now is None  # no stack at all: not waited for again
            who = "no local stack placed" if now is None else "the local stack has not placed"
            ctx.progress.message(
                f"{who} {target}'s processes on the CPU budget within {waited:.1f} s: "
                f"phase {phase} goes on without waiting"
            )
            return
        await asyncio.sleep(POLL_S)


async def handed_over(ctx: RolloutContext, target: str) -> None:
    """Wait, at most ``hand_over_s``, until no CPU budget holds T's processes: in the
    switch phase a local stack moves them to serving's CPUs, so that T's first searches
    do not share the budget's CPU with this builder's end. Nothing to wait for without a
    budget, or without a stack placing one (its record expires)."""
    deadline = time.monotonic() + ctx.options.hand_over_s
    while _placed_now(ctx) == target:
        if time.monotonic() > deadline:
            ctx.progress.message(
                f"{target}'s processes are still on the rollout's CPU budget after "
                f"{ctx.options.hand_over_s:.0f} s: switching anyway"
            )
            return
        await asyncio.sleep(POLL_S)
