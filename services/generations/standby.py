"""A generation's shard pods wait for it to exist and publish where they are (issue #24).

In Kubernetes the chart runs the shards of every generation its values list
(``index.generations``), one StatefulSet per shard each. A rollout creates its target in
the registry as it goes and trains its quantizer first, so the target's pods may start
before there is anything to serve. Their init container (``gtr-retrieval index
await-generation``) waits until the registry records the generation with a trained index
(``params["trained"]``; g1 needs no record: its shards create it), checks that the pod
reads the index where the rollout wrote it, and writes the generation's shard addresses
(the chart's deterministic headless-Service names) into ``{gtr}:addrs``, where the
gateway and the rollout find them. A listed generation that the registry retired, or
whose rollout failed, is an error that names it (remove it from the values).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from services.common.errors import FailedPrecondition, NotFound
from services.generations.registry import RUNNING, Generation, Registry
from services.index.keys import FIRST_GENERATION

log = logging.getLogger(__name__)


def ready_to_serve(gen: Generation) -> bool:
    return gen.name == FIRST_GENERATION or bool(gen.params.get("trained"))


def await_generation(
    registry: Registry,
    name: str,
    addresses: str,
    *,
    index_dir: str | None = None,
    num_shards: int | None = None,
    poll_s: float = 2.0,
    timeout_s: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Any] = time.sleep,
) -> Generation | None:
    """Wait until generation ``name`` may start serving, then record ``addresses`` for it.

    g1 is not waited for (its shards record it when the store has no generation yet);
    its addresses are recorded at once. Returns the record (None for a g1 not yet
    recorded). FailedPrecondition: the generation is retired or failed, has another shard
    count than ``num_shards``, or its index is elsewhere than ``index_dir``; TimeoutError
    past ``timeout_s``."""
    give_up = None if timeout_s is None else clock() + timeout_s
    said = clock() - 60.0
    while True:
        try:
            gen: Generation | None = registry.get(name)
        except NotFound:
            gen = None
        if gen is None and name == FIRST_GENERATION:
            registry.set_addresses(name, addresses)
            return None
        if gen is not None and gen.state not in RUNNING:
            raise FailedPrecondition(
                f"generation {name} is {gen.state}: its shards have nothing to serve "
                "(remove it from index.generations)"
            )
        if gen is not None and num_shards is not None and gen.num_shards != num_shards:
            raise FailedPrecondition(
                f"generation {name} has {gen.num_shards} shards, but this pod is one of "
                f"{num_shards}: set its shards in index.generations to {gen.num_shards}"
            )
        if gen is not None and ready_to_serve(gen):
            if index_dir is not None and gen.index_dir.rstrip("/") != index_dir.rstrip("/"):
                raise FailedPrecondition(
                    f"generation {name}'s trained index is at {gen.index_dir}, but this pod "
                    f"reads {index_dir}: set its indexDir in index.generations (or the "
                    "rollout's --index-root) so that they agree"
                )
            registry.set_addresses(name, addresses)
            return gen
        now = clock()
        if give_up is not None and now >= give_up:
            raise TimeoutError(f"generation {name} was not ready within {timeout_s} s")
        if now - said >= 60.0:
            said = now
            log.info(
                "waiting for generation %s: %s",
                name,
                "not recorded yet" if gen is None else f"{gen.state}, quantizer not trained yet",
            )
        sleep(poll_s)
