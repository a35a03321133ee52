"""The PQ error of the vectors a shard added recently, against the error at training: the
drift that says when the index wants retraining (``pq_error_ratio`` in its stats).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

from services.index.core.trained import pq_error

DRIFT_WINDOW = 10_000  # recent adds over which the PQ error is averaged


class PqDrift:
    """The mean PQ error over about the last :data:`DRIFT_WINDOW` added vectors."""

    def __init__(self, count: int = 0, total: float = 0.0) -> None:
        self._batches: deque[tuple[int, float]] = deque()
        self.count = count
        self.total = total
        if count:
            self._batches.append((count, total))

    def track(self, index: Any, vectors: np.ndarray) -> None:
        """Add the PQ error of ``vectors`` (just added to ``index``) to the window."""
        error = pq_error(index, vectors)
        n = len(vectors)
        self._batches.append((n, error * n))
        self.count += n
        self.total += error * n
        while self.count - self._batches[0][0] >= DRIFT_WINDOW:
            old_n, old_sum = self._batches.popleft()
            self.count -= old_n
            self.total -= old_sum

    @property
    def mean(self) -> float:
        """The window's mean PQ error (0 before any add)."""
        return self.total / self.count if self.count else 0.0
