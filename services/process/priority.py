"""A process's scheduling weight against other sessions: a rollout's processes yield the
CPUs to serving (docs/generations.md "A rollout yields the CPUs"), and Triton, while it
encodes only documents, waits behind the searches' work (:data:`BACKGROUND_NICE`,
docs/performance.md "Searches before document encodes").

On Linux with autogroup (``kernel.sched_autogroup_enabled``, the default of most
distributions and of this machine's kernel), the scheduler shares the CPUs between
*sessions* first (each session's processes form an autogroup of weight 1024 at nice 0),
then between the threads of one session. A thread's own nice, and its ``SCHED_IDLE`` policy,
only order it within its session: a rollout's CLI at nice 19 in a session of its own still
weighed as much as the gateway's whole session (the ``SCHED_IDLE`` trial of 2026-12-01 read
1.67x, no better). The lever is the session's weight, ``/proc/<pid>/autogroup``: at nice 19
it weighs 15 against serving's 1024 each, so a serving thread woken on a CPU the rollout
runs on takes it at once.

Setting it needs no privilege for nice >= 0 (raising it back to 0 included), but the kernel
takes one change per 100 ms from a process without ``CAP_SYS_ADMIN`` (``EAGAIN``):
:func:`set_group_nice` says so and the caller tries again on its next pass. Only a process
that leads its session is given a weight (:func:`leads_session`): any other shares its
autogroup with its session's other processes (the operator's shell). Every child of ``up``
and the CLI under ``bench`` lead theirs. Without autogroup (the processes in a cgroup of
their own, as in Kubernetes) the cgroup's CPU weight is the lever, which the chart sets.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

YIELD_NICE = 19  # the least weight: 15 against nice 0's 1024
AUTOGROUP_ENABLED = Path("/proc/sys/kernel/sched_autogroup_enabled")
# "0" keeps a rollout's processes at full weight (both the CLI and `up` read it): to
# measure what yielding does (bench.rollout_rounds runs with and without)
YIELD_ENV = "GTR_ROLLOUT_YIELD"


def yield_enabled() -> bool:
    return os.environ.get(YIELD_ENV, "1") != "0"


def autogroup_enabled() -> bool:
    try:
        return AUTOGROUP_ENABLED.read_text().strip() == "1"
    except OSError:
        return False


def leads_session(pid: int) -> bool:
    try:
        return os.getsid(pid) == pid
    except OSError:
        return False


def group_nice(pid: int) -> int | None:
    """The nice of ``pid``'s autogroup (``/autogroup-N nice X``); None without autogroup
    or when the process is gone."""
    try:
        text = Path(f"/proc/{pid}/autogroup").read_text()
    except OSError:
        return None
    _, _, nice = text.rpartition(" nice ")
    return int(nice) if nice.strip().lstrip("-").isdigit() else None


def set_group_nice(pid: int, nice: int) -> bool | None:
    """Give ``pid``'s autogroup (its session's processes) the weight of ``nice``: True
    done (or already so), None not now (the kernel's 100 ms between two changes: try again
    later), False not possible (no autogroup, no such process, not allowed)."""
    if group_nice(pid) == nice:
        return True
    try:
        with open(f"/proc/{pid}/autogroup", "w") as fh:
            fh.write(str(nice))
    except OSError as err:
        return None if err.errno == errno.EAGAIN else False
    return True


# the session nice of a process whose work waits behind the searches' when both want a
# CPU: Triton while it only encodes documents (the stack's --triton-nice; docs/performance.md
# "Searches before document encodes"); 10 weighs 110 against nice 0's 1024
BACKGROUND_NICE = 10
SETTLE_S = 1.0  # how long settle_group_nice retries the kernel's 100 ms limit


def settle_group_nice(pid: int, nice: int, timeout_s: float = SETTLE_S) -> bool:
    """:func:`set_group_nice`, tried again while the kernel defers it (another change in
    the last 100 ms, anywhere on the machine), for up to ``timeout_s``: True done, False
    not possible or still deferred."""
    deadline = time.monotonic() + timeout_s
    while True:
        done = set_group_nice(pid, nice)
        if done is not None:
            return done
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
