"""A thread's scheduler time slice (``sched_setattr(2)``'s ``sched_runtime`` for a fair
task, Linux 6.12+): ``bench.busy_budget``'s ``short`` kind and ``--stack-slice-us``.

EEVDF protects a running task's slice from a woken one; a short slice (down to 0.1 ms,
against 0.7-3 ms by default) should let a woken serving thread take the CPU sooner. On
this machine it did not (docs/generations.md, "What the scheduler can and cannot give
back"), so nothing in the services sets it: this is the bench's, to measure it again.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

# sched_setattr / sched_getattr (no glibc wrapper)
SYSCALLS = {"x86_64": (314, 315), "aarch64": (274, 275)}
SHORT_SLICE_NS = 100_000  # the least slice the kernel takes


class _SchedAttr(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_uint32),
        ("policy", ctypes.c_uint32),
        ("flags", ctypes.c_uint64),
        ("nice", ctypes.c_int32),
        ("priority", ctypes.c_uint32),
        ("runtime", ctypes.c_uint64),
        ("deadline", ctypes.c_uint64),
        ("period", ctypes.c_uint64),
    ]


def _read(tid: int) -> tuple[Any, int, _SchedAttr] | None:
    """(libc, sched_setattr's number, thread ``tid``'s attributes); None when unknown here."""
    numbers = SYSCALLS.get(os.uname().machine)
    if numbers is None:
        return None
    libc, (set_, get) = ctypes.CDLL(None, use_errno=True), numbers
    attr = _SchedAttr()
    if libc.syscall(get, tid, ctypes.byref(attr), ctypes.sizeof(attr), 0) != 0:
        return None
    return libc, set_, attr


def thread_slice(tid: int) -> int | None:
    """Thread ``tid``'s slice in ns (0: this thread); None when unknown here."""
    read = _read(tid)
    return None if read is None else int(read[2].runtime)


def set_slice(tid: int, slice_ns: int) -> bool:
    """Give thread ``tid`` (0: this one; threads it starts later inherit it) a slice of
    ``slice_ns``, its policy and nice kept; False when refused or unknown here."""
    read = _read(tid)
    if read is None:
        return False
    libc, set_, attr = read
    if attr.policy not in (os.SCHED_OTHER, os.SCHED_BATCH, os.SCHED_IDLE):
        return False
    attr.size = ctypes.sizeof(attr)
    attr.runtime = slice_ns
    return libc.syscall(set_, tid, ctypes.byref(attr), 0) == 0
