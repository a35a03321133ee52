"""Whether the target's shard replicas serve and applied its logs, from their ``Stats``:
what the catch-up waits for before it hands the target over (so that they apply their
backlog on the rollout's CPU budget, paused while searches run, not on serving's CPUs), and
what the switch waits for before and after it closes the source's writes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from services.common import positions
from services.common.errors import Unavailable
from services.generations import logs
from services.generations.context import RolloutContext
from services.generations.registry import Generation
from services.generations.replicas import all_stats, parse_addresses

# With the writes closed: how long one ask of T's replicas waits for them to apply the
# tails, and the first pause before asking again (a replica that did not answer)
CLOSED_WAIT_S = 1.0
CLOSED_POLL_S = 0.01


async def replicas_ready(
    ctx: RolloutContext, target: Generation, replay: Callable[[], Awaitable[object]]
) -> bool:
    """Replay the writes that go on (``replay``) while T's replicas come up and apply what
    T's logs hold now, for at most ``shard_wait_s``: True once they did. A new
    generation's shard processes start once it is trained and take seconds to serve; a
    reshard reaches its switch sooner than that, and waited for with the writes closed,
    every write paused as long (2 s, test_generations_e2e's reshard). Not ready in time:
    the switch waits again with the writes closed, as before."""
    if not ctx.options.wait_for_shards:
        return True
    # what T's logs hold now: a mark that stays put while the replay appends the writes
    # that go on (replicas always a step behind the newest tails would never be ready)
    mark = logs.tails(ctx.client, ctx.keys(target))
    deadline = time.monotonic() + ctx.options.shard_wait_s
    while time.monotonic() < deadline:
        if await all_applied(ctx, target, mark):
            return True
        await asyncio.sleep(0.2)
        await replay()  # the writes meanwhile: the closed replay stays short
    return False


async def target_applied(ctx: RolloutContext, target: Generation, tails: dict[int, str]) -> bool:
    """True once every replica of T's shards applied ``tails`` (or, without waiting for
    shards, at once). Asked with the writes closed, when every write waits for the switch
    (and, paused, lends its admission units back): each replica is asked to answer once it
    has applied its shard's tail (``Stats`` with ``applied_at_least``), which it makes
    searchable at once rather than at its next text-index refresh (up to 250 ms later;
    a Stats poll every 10-200 ms waited for that refresh). A replica that does not answer
    in :data:`CLOSED_WAIT_S` is asked again, until ``shard_wait_s``."""
    if not ctx.options.wait_for_shards:
        return True
    deadline = time.monotonic() + ctx.options.shard_wait_s
    pause = CLOSED_POLL_S
    while (left := deadline - time.monotonic()) > 0:
        if await all_applied(ctx, target, tails, wait_s=min(CLOSED_WAIT_S, left)):
            return True
        await asyncio.sleep(pause)  # a replica down or restarting: not a busy loop
        pause = min(2 * pause, 0.2)
    return False


async def all_applied(
    ctx: RolloutContext, target: Generation, tails: dict[int, str], wait_s: float = 0.0
) -> bool:
    """Whether every replica of T's shards (by their recorded addresses) applied ``tails``;
    ``wait_s`` > 0: each replica answers once it has (or DEADLINE_EXCEEDED after that)."""
    spec = ctx.registry.addresses(target.name)
    if not spec:
        return False
    applied = await _applied(ctx, spec, tails if wait_s > 0 else {}, wait_s)
    return len(applied) == len(tails) and all(
        replicas and all(p is not None and positions.at_least(p, tails[s]) for p in replicas)
        for s, replicas in enumerate(applied)
    )


async def _applied(
    ctx: RolloutContext, spec: str, tails: dict[int, str], wait_s: float
) -> list[list[str | None]]:
    if ctx.wiring.applied is not None:
        return await ctx.wiring.applied(spec)
    out: list[list[str | None]] = []
    shards = parse_addresses(spec)
    wanted = [tails.get(s, "") for s in range(len(shards))]
    stats = await all_stats(spec, ctx.wiring.shard_tls, wait_s or 5.0, wanted)
    for addresses, replicas in zip(shards, stats, strict=True):
        for address, r in zip(addresses, replicas, strict=True):
            if isinstance(r, Unavailable):
                await ctx.check_transport(address)
        out.append([getattr(r, "applied", None) for r in replicas])
    return out
