"""The source's log entries a rollout holds, and their bound (docs/generations.md, "Catch-up
under writes").

From P0 to the switch the rollout's hold (``rollout:<T>``) keeps S's shards from trimming
S's logs past the replay position: every write since is kept until it is replayed. The
entries held are the *lag*, Redis's count of entries added to S's logs since P0
(``XINFO STREAM`` ``entries-added``) minus those replayed. A rollout that cannot catch up
(a builder slower than the writers, a builder stopped for long) would grow S's logs
without end, so :func:`enforce_bound` ends it once the lag passes
``RolloutOptions.max_held_entries`` (``--max-held-entries``; 0: no bound): the rollout is
aborted (the hold released, the writes stay on S, T ``failed``) and
:class:`HeldEntriesExceeded` (FAILED_PRECONDITION) says why and what to do.
"""

from __future__ import annotations

from services.generations import logs, rollback
from services.generations.context import RolloutContext
from services.generations.errors import HeldEntriesExceeded


def lag_and_added(ctx: RolloutContext) -> tuple[int, int] | None:
    """(entries of S's logs not yet replayed, entries ever added to S's logs); None when
    the count at P0 is unknown (a rollback to a generation switched away from before that
    count was recorded)."""
    src = ctx.keys(ctx.source())
    added0, replayed = ctx.state.added0, ctx.state.replayed
    if not added0:
        return None
    added = {s: logs.entries_added(ctx.client, src.log(s)) for s in range(src.num_shards)}
    lag = sum(
        max(0, added[s] - added0.get(s, 0) - replayed.get(s, 0)) for s in range(src.num_shards)
    )
    return lag, sum(added.values())


def lag_of(ctx: RolloutContext) -> int | None:
    """Entries of S's logs not yet replayed (:func:`lag_and_added`)."""
    got = lag_and_added(ctx)
    return None if got is None else got[0]


def enforce_bound(ctx: RolloutContext, lag: int | None) -> None:
    """Abort the rollout and raise :class:`HeldEntriesExceeded` when ``lag`` (the entries
    held) passes ``max_held_entries``."""
    bound = ctx.options.max_held_entries
    if not bound or lag is None or lag <= bound:
        return
    state = ctx.state
    progress = ctx.progress
    rates = (
        f" (replay {progress.rate:.1f}/s against writes {progress.write_rate:.1f}/s)"
        if progress.current == "catch_up"
        else f" (phase {state.phase})"
    )
    rollback.abort(ctx.client, ctx.registry, state)
    if state.kind == "rollout":
        ctx.registry.set_state(state.target, "failed", note="aborted: max held entries")
    raise HeldEntriesExceeded(
        f"the rollout to {state.target} held {lag} entries of {state.source}'s logs, more "
        f"than --max-held-entries {bound}{rates}: it was aborted and its hold released "
        f"(writes go on to {state.source}; {state.target} failed). Roll out again when "
        "the writes are fewer or the builder faster (--cpus), or with a larger bound"
    )
