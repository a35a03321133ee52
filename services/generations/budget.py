"""A rollout's CPU budget, the builder's side (``index rollout --cpus``; the local stack's
side is :mod:`services.generations.placement`, the design docs/generations.md "A rollout's CPU
budget").

:class:`CpuBudget` records the budget (the CLI pinned its own process to it first, before
the publish's export) in
:data:`~services.index.keys.CPU_BUDGET_KEY` with a TTL of :data:`TTL_S`, renewed every
:data:`RENEW_S` by a thread of its own until the rollout ends: a builder killed with
``-9`` leaves its target's shards on the budget for at most the TTL. On exit the key and
the budget files of the Triton repository's version folders go. (Until 2026-12-01 the key
said "ending" with the CLI's pid and the stack held the budget until that process had
exited; once serving kept every CPU, that moved no process: nothing of the stack is on
the budget after the hand-over, and the CLI pinned itself.)
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from services.index.keys import CPU_BUDGET_KEY
from services.process import cpus as cpu_sets

log = logging.getLogger(__name__)

TTL_S = 30
RENEW_S = 10.0


def parse(raw: str) -> frozenset[int]:
    """The CPUs of the key's value; InvalidArgument when it is no CPU list."""
    return cpu_sets.parse_cpus(raw)


class CpuBudget:
    """``with CpuBudget(redis, cpus, repo):`` for as long as a rollout runs."""

    def __init__(self, client: Any, cpus: frozenset[int], triton_repo: Path | None) -> None:
        self.client = client
        self.cpus = cpus
        self.triton_repo = triton_repo
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> CpuBudget:
        self._record()
        self._thread = threading.Thread(target=self._renew, name="cpu-budget", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self.client.delete(CPU_BUDGET_KEY)
        except Exception as err:  # the TTL ends it anyway
            log.warning("could not end %s (it expires in %d s): %s", CPU_BUDGET_KEY, TTL_S, err)
        if self.triton_repo is not None:
            from services.encoder.serve.versions import clear_cpu_budgets

            clear_cpu_budgets(self.triton_repo)

    def _record(self) -> None:
        self.client.set(CPU_BUDGET_KEY, cpu_sets.format_cpus(self.cpus), ex=TTL_S)

    def _renew(self) -> None:
        while not self._stop.wait(RENEW_S):
            try:
                self._record()
            except Exception as err:  # Redis restarting: the next renewal
                log.debug("renewing %s: %s", CPU_BUDGET_KEY, err)
