"""Where a slow write's time went: each attempt on a generation, the alias re-reads and
pauses between them, its encodes and the store's write, timed and logged as one warning
when the write took longer than :data:`SLOW_WRITE_S` or ended without an answer (its
deadline, a cancellation). A write that hangs at a switch then says where it waited.

The trail of the write being handled lives in a context variable (:func:`step` is a
no-op outside one), so the pipeline's steps need no extra argument. No grpc here.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import logging
import time
from collections.abc import Iterator

log = logging.getLogger(__name__)

# a write slower than this is logged with its trail
SLOW_WRITE_S = 2.0
# how a write ends without an answer of its own: its trail is logged however fast
UNANSWERED = ("cancelled", "timed out", "DeadlineExceeded")
# a trail keeps its first and its last steps; a write that loops says how many between
_HEAD_STEPS = 8
_TAIL_STEPS = 24

_CURRENT: contextvars.ContextVar[WriteTrail | None] = contextvars.ContextVar(
    "gtr_write_trail", default=None
)


class WriteTrail:
    """The timed steps of one write (see the module's docstring)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.started = time.monotonic()
        self.head: list[str] = []
        self.tail: collections.deque[str] = collections.deque(maxlen=_TAIL_STEPS)
        self.dropped = 0

    def add(self, text: str) -> None:
        if len(self.head) < _HEAD_STEPS:
            self.head.append(text)
            return
        if len(self.tail) == self.tail.maxlen:
            self.dropped += 1
        self.tail.append(text)

    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def report(self, outcome: str) -> None:
        """Log the trail when the write was slow or ended without an answer."""
        took = self.elapsed_s()
        if took < SLOW_WRITE_S and outcome not in UNANSWERED:
            return
        steps = [*self.head, *([f"... {self.dropped} steps ..."] if self.dropped else [])]
        steps += self.tail
        log.warning(
            "slow write: %s ended %s after %.0f ms: %s",
            self.what,
            outcome,
            took * 1000,
            "; ".join(steps) or "no step ended",
        )


@contextlib.contextmanager
def trail(what: str) -> Iterator[WriteTrail]:
    """The trail of the write ``what`` for the steps inside; reported at the end."""
    current = WriteTrail(what)
    token = _CURRENT.set(current)
    outcome = "ok"
    try:
        yield current
    except BaseException as exc:
        outcome = _outcome(exc)
        raise
    finally:
        _CURRENT.reset(token)
        current.report(outcome)


@contextlib.contextmanager
def step(what: str, timed: bool = True) -> Iterator[None]:
    """Time ``what`` in the current write's trail (nothing outside a write, or when not
    ``timed``: a step with nothing to do)."""
    current = _CURRENT.get()
    if current is None or not timed:
        yield
        return
    began = time.monotonic()
    at = (began - current.started) * 1000
    ended = "done"
    try:
        yield
    except BaseException as exc:
        ended = _outcome(exc)
        raise
    finally:
        took = (time.monotonic() - began) * 1000
        current.add(f"{what} at {at:.0f} ms: {took:.0f} ms {ended}")


def _outcome(exc: BaseException) -> str:
    """How a write or one of its steps ended, in a word or two."""
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled"
    if isinstance(exc, TimeoutError):
        return "timed out"
    return type(exc).__name__
