"""A request's deadline, carried through the stages as an absolute monotonic time."""

from __future__ import annotations

import time
from dataclasses import dataclass

from services.common.errors import DeadlineExceeded


@dataclass(frozen=True)
class Deadline:
    """``at`` is a ``time.monotonic()`` instant, or None for no deadline."""

    at: float | None

    @classmethod
    def after(cls, seconds: float | None) -> Deadline:
        return cls(None if seconds is None else time.monotonic() + seconds)

    def remaining(self) -> float | None:
        """Seconds left (never negative), or None when there is no deadline."""
        if self.at is None:
            return None
        return max(0.0, self.at - time.monotonic())

    def remaining_ms(self, default: float = float("inf")) -> float:
        left = self.remaining()
        return default if left is None else left * 1000.0

    def check(self, stage: str) -> None:
        """Raise DeadlineExceeded when the deadline has passed before ``stage``."""
        if self.at is not None and time.monotonic() >= self.at:
            raise DeadlineExceeded(f"deadline exceeded before {stage}")
