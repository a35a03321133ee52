"""When the log consumer makes what it applied searchable in the text index.

A batch of log entries reaches a shard's vectors at once and its text index staged
(:meth:`~services.index.core.shard.IvfPqShard.apply` with ``refresh=False``); a refresh
(a Tantivy commit: a new segment, its files synced, a new searcher) makes the text
searchable and moves the shard's ``applied`` position. It costs about 10 ms of CPU
however few the changes (docs/index.md "The text index's refresh"), so at a steady
trickle of writes one refresh per batch spent more CPU than the searches did. The
consumer refreshes:

- every ``every_s`` (``--text-refresh-s``, 0.25 s; 0: after every batch), counted from
  the first change left unrefreshed;
- at once when a SESSION search waits for a position the vectors hold
  (:meth:`~services.index.server.replica.ShardReplica.wait_for`);
- at once when the replay of the log at start has caught up (the replica turns ready);
- before a snapshot (:func:`~services.index.core.snapshots.export_state`).

The shard's refresh runs outside its write lock: searches never wait for a commit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from services.index.core.shard import IvfPqShard


class Refresher:
    """The consumer's refresh schedule and the lag of what it made searchable."""

    def __init__(self, every_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = every_s
        self._clock = clock
        self._lock = threading.Lock()
        self._since: float | None = None  # when the oldest unrefreshed batch was applied
        self._oldest_ms: int | None = None  # its oldest entry's log time (ms since epoch)
        self.refreshes = 0

    def applied(self, oldest_entry_ms: int) -> None:
        """A batch went in staged; ``oldest_entry_ms``: its oldest entry's log time."""
        with self._lock:
            if self._since is None:
                self._since = self._clock()
            if self._oldest_ms is None or oldest_entry_ms < self._oldest_ms:
                self._oldest_ms = oldest_entry_ms

    def due(self, shard: IvfPqShard) -> bool:
        """Whether ``shard`` has changes waiting and their time has come."""
        with self._lock:
            since = self._since
        if not shard.pending:
            return False
        return since is None or self._clock() - since >= self.every_s

    def refresh(self, shard: IvfPqShard) -> float | None:
        """Refresh ``shard``; the age in seconds of the oldest change it made searchable
        (None: there was none, and nothing was committed)."""
        with self._lock:
            pending = shard.pending
            shard.refresh()
            oldest, self._since, self._oldest_ms = self._oldest_ms, None, None
            self.refreshes += pending
        if not pending or oldest is None:
            return None
        return max(0.0, time.time() - oldest / 1000.0)
