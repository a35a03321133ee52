"""Rollback and abort: the two ways back to the source generation.

A **rollback** makes the previous generation serve again: the serving generation's logs
since its switch are replayed into the previous one (re-embedded with its encoder), then
the same switch; it is the rollout machine started at ``catch_up``. An **abort** closes a
rollout that has not switched: writes back to the source, the target ``failed`` (a
rollback's target back to ``previous``), the holds released.
"""

from __future__ import annotations

import time

from services.common.errors import FailedPrecondition, NotFound
from services.generations import logs
from services.generations.registry import Registry
from services.generations.state import RolloutState
from services.process.redis_client import SyncRedis


def begin_rollback(client: SyncRedis, registry: Registry, owner: str) -> RolloutState:
    """Check that a rollback can run, take the lock for it and hold the serving
    generation's logs from its switch-in; the state recorded."""
    alias = registry.alias()
    if not alias.previous:
        raise FailedPrecondition(
            f"no previous generation to roll back to ({alias.serving} serves and none "
            "served before it, or it was retired)"
        )
    target = registry.get(alias.previous)
    serving = registry.get(alias.serving)
    if target.state != "previous":
        raise FailedPrecondition(f"generation {target.name} is {target.state}, not previous")
    if not serving.switch_in:
        raise FailedPrecondition(
            f"{serving.name} has no switch-in positions (it never switched in): nothing "
            "to replay from"
        )
    src = registry.keys(serving)
    start = {int(s): p for s, p in serving.switch_in.items()}
    for shard, position in start.items():
        if logs.trimmed_past(client, src.log(shard), position):
            raise FailedPrecondition(
                f"{src.log(shard)} was trimmed past the switch ({position}): the writes "
                f"since cannot be replayed into {target.name}; roll out a new generation "
                "instead"
            )
    now = time.time()
    state = RolloutState(
        target=target.name,
        source=serving.name,
        kind="rollback",
        mode="replay",
        phase="catch_up",
        started_at=now,
        owner=owner,
        beat=now,
        target_state=target.state,
        p0=dict(start),
        positions=dict(start),
        replayed={},
        added0={int(s): int(n) for s, n in serving.params.get("switch_added", {}).items()},
    )
    state = state.with_(host=_host(), pid=_pid())
    registry.begin_rollout(state.to_fields())
    logs.hold(client, src, start, f"rollout:{target.name}")
    registry.set_state(target.name, "catching_up")
    return state


def abort(client: SyncRedis, registry: Registry, running: RolloutState) -> None:
    """Close ``running`` (its builder known to be gone): see the module's docstring."""
    target, source = running.target, running.source
    alias = registry.alias()
    if alias.serving == target:
        registry.end_rollout()  # the switch had happened: only the lock was left
        raise FailedPrecondition(
            f"{target} serves already (the switch was done); `index rollback` returns to {source}"
        )
    src = registry.keys(registry.get(source))
    registry.set_gates(src.layout, source)
    logs.release(client, src, f"rollout:{target}")
    logs.drop_late_vectors(client, src, target)
    try:
        registry.get(target)
    except NotFound:
        pass
    else:
        if running.kind == "rollback":
            registry.set_state(target, running.target_state or "previous")
        else:
            registry.set_state(target, "failed", note="aborted")
    registry.end_rollout()


def _host() -> str:
    import socket

    return socket.gethostname()


def _pid() -> int:
    import os

    return os.getpid()
