"""A call's wait that does no work, as the layer that admitted the call may want to know
(:class:`services.rpc.admission.Admission`: the call's units are lent back while it waits).

The gateway's writes pause while a switch has closed the writer gates (a few hundred
milliseconds, the writes arriving meanwhile all waiting: 21 writes/s over a 1.2-s switch
held 24 of a 32-unit limit in a bench, and the searches of every client were refused).
The code that waits says so (:func:`parked`); the RPC layer that admitted the call says
what parking means for it (:func:`parking`), through a context variable, so that this
package's callers need not know of RPC admission (and the core imports no grpc).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from contextvars import ContextVar

Park = Callable[[], AbstractContextManager[None]]

_PARK: ContextVar[Park | None] = ContextVar("gtr_park", default=None)


def parked() -> AbstractContextManager[None]:
    """Around a wait of the current call that does no work: what the admitting layer set
    with :func:`parking`, or nothing."""
    park = _PARK.get()
    return park() if park is not None else contextlib.nullcontext()


@contextlib.contextmanager
def parking(park: Park | None) -> Iterator[None]:
    """While the block runs (one call), :func:`parked` means ``park()``."""
    token = _PARK.set(park)
    try:
        yield
    finally:
        _PARK.reset(token)
