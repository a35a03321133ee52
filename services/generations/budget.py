"""A rollout's CPU budget, the builder's side (``index rollout --cpus``; the local stack's
side is :mod:`services.generations.placement`, the design docs/generations.md "A rollout's CPU
budget").

:class:`CpuBudget` records the budget (the CLI pinned its own process to it first, before
the publish's export) in
:data:`~services.index.keys.CPU_BUDGET_KEY` with a TTL of :data:`TTL_S`, renewed every
:data:`RENEW_S` by a thread of its own until the rollout ends: a builder killed with
``-9`` leaves serving narrowed for at most the TTL. On exit the budget files of the
Triton repository's version folders go, and the key says the budget is **ending** with
this process's id (:func:`ending`, a TTL of :data:`ENDING_TTL_S`): the local stack keeps
the budget until that process has exited. The process's own end (the interpreter's
teardown of torch, ONNX Runtime and the rest: ~0.3-0.7 s of CPU) then stays on the
budget's CPUs, instead of landing on serving's once they were widened (measured:
docs/generations.md "The switch phase, traced").
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

from services.index.keys import CPU_BUDGET_KEY
from services.process import cpus as cpu_sets

log = logging.getLogger(__name__)

TTL_S = 30
RENEW_S = 10.0
# an ending budget's TTL: longer than a process's end, short enough that a CLI whose
# exit hangs (or that runs where the stack cannot see its pid) narrows serving briefly
ENDING_TTL_S = 10
ENDING = " ending "  # "<cpus> ending <pid>"


def ending(cpus: frozenset[int], pid: int) -> str:
    """The key's value once the rollout ended and process ``pid`` is exiting."""
    return f"{cpu_sets.format_cpus(cpus)}{ENDING}{pid}"


def parse(raw: str) -> tuple[frozenset[int], int | None]:
    """(CPUs, the exiting process's pid or None) of the key's value; InvalidArgument when
    it is neither form."""
    spec, _, pid = raw.partition(ENDING)
    return cpu_sets.parse_cpus(spec), (int(pid) if pid.strip().isdigit() else None)


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
        try:  # held until this process has exited (the stack checks its pid)
            self.client.set(CPU_BUDGET_KEY, ending(self.cpus, os.getpid()), ex=ENDING_TTL_S)
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
