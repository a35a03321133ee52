"""A clock the test moves by hand (``clock.now = 12.5``), for code that takes a
``clock: Callable[[], float]``."""

from __future__ import annotations


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
