"""FAISS id → storage slot, looked up for a whole batch of candidates at once.

A search turns every IVF-PQ candidate (a 63-bit FAISS id) into the row of its SQ8 code
and of its document id. With a dict that is one Python lookup per candidate, and each
lookup misses the cache twice (the table, then the key object): measured, it cost as
much as a third of the FAISS scan of a 15-query batch. This table keeps keys and slots
in two numpy arrays (open addressing with linear probing; the ids are hashes already,
so their low bits are the bucket) and serves every operation a batch at a time, as a
few vectorised probe rounds.
"""

from __future__ import annotations

import numpy as np

EMPTY = -1  # never used: a probe stops here
GONE = -2  # a deleted entry: a probe goes past it, an insert may reuse it
MIN_BUCKETS = 1024
MAX_LOAD = 0.5  # (live + deleted) entries per bucket before the table is rebuilt


class SlotTable:
    """``fid → slot`` for non-negative FAISS ids and slots."""

    def __init__(self, capacity: int = 0) -> None:
        self._keys, self._slots = _buckets(capacity)
        self._live = 0
        self._used = 0  # live + GONE buckets

    def __len__(self) -> int:
        return self._live

    @property
    def nbytes(self) -> int:
        return int(self._keys.nbytes + self._slots.nbytes)

    def __contains__(self, fid: int) -> bool:
        return bool(self._find(np.array([fid], dtype=np.int64))[0] >= 0)

    def lookup(self, fids: np.ndarray) -> np.ndarray:
        """The slot of each id of ``fids`` (any shape), -1 where absent or negative."""
        flat = np.asarray(fids, dtype=np.int64).ravel()
        at = self._find(flat)
        out = np.where(at >= 0, self._slots[np.maximum(at, 0)], -1)
        return out.reshape(np.shape(fids))

    def add(self, fids: np.ndarray, slots: np.ndarray) -> None:
        """Map each of ``fids`` (distinct, non-negative, not present) to its slot."""
        fids = np.asarray(fids, dtype=np.int64).ravel()
        slots = np.asarray(slots, dtype=np.int64).ravel()
        if len(fids) != len(slots):
            raise ValueError(f"{len(fids)} ids for {len(slots)} slots")
        if not len(fids):
            return
        if (fids < 0).any() or (slots < 0).any():
            raise ValueError("ids and slots are non-negative")
        if len(np.unique(fids)) != len(fids) or (self._find(fids) >= 0).any():
            raise ValueError("ids must be distinct and not present")
        if self._used + len(fids) > MAX_LOAD * len(self._keys):
            self._rebuild(self._live + len(fids))
        self._used += _place(self._keys, self._slots, fids, slots)
        self._live += len(fids)

    def remove(self, fids: np.ndarray) -> np.ndarray:
        """Remove ``fids`` (distinct); their slots, -1 for those absent."""
        fids = np.asarray(fids, dtype=np.int64).ravel()
        at = self._find(fids)
        present = at >= 0
        out = np.where(present, self._slots[np.maximum(at, 0)], -1)
        self._keys[at[present]] = GONE
        self._live -= int(present.sum())
        return out

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """(fids, slots) of the live entries, in bucket order."""
        live = self._keys >= 0
        return self._keys[live].copy(), self._slots[live].copy()

    def _find(self, fids: np.ndarray) -> np.ndarray:
        """The bucket of each id, -1 where absent (vectorised linear probing)."""
        keys, mask = self._keys, len(self._keys) - 1
        out = np.full(fids.shape, -1, dtype=np.int64)
        todo = np.flatnonzero(fids >= 0)
        at = fids[todo] & mask
        while todo.size:
            found = keys[at]
            hit = found == fids[todo]
            out[todo[hit]] = at[hit]
            going = ~hit & (found != EMPTY)
            todo, at = todo[going], (at[going] + 1) & mask
        return out

    def _rebuild(self, capacity: int) -> None:
        fids, slots = self.items()
        self._keys, self._slots = _buckets(capacity)
        self._used = _place(self._keys, self._slots, fids, slots)


def _buckets(capacity: int) -> tuple[np.ndarray, np.ndarray]:
    size = MIN_BUCKETS
    while size * MAX_LOAD < capacity:
        size *= 2
    return np.full(size, EMPTY, dtype=np.int64), np.zeros(size, dtype=np.int64)


def _place(keys: np.ndarray, slots: np.ndarray, fids: np.ndarray, values: np.ndarray) -> int:
    """Insert absent, distinct ``fids``; the number of EMPTY buckets taken.

    Each round, every id still waiting tries its current bucket; of those landing on
    the same free bucket the first takes it, the others (and those on a taken bucket)
    move one bucket on. Every id ends at the first free bucket on its probe path,
    as one-at-a-time inserts would put it.
    """
    mask = len(keys) - 1
    todo = np.arange(len(fids))
    at = fids & mask
    emptied = 0
    while todo.size:
        free = keys[at] < 0
        buckets, first = np.unique(at[free], return_index=True)
        winners = todo[free][first]
        emptied += int((keys[buckets] == EMPTY).sum())
        keys[buckets] = fids[winners]
        slots[buckets] = values[winners]
        waiting = np.ones(len(todo), dtype=bool)
        waiting[np.flatnonzero(free)[first]] = False
        todo, at = todo[waiting], (at[waiting] + 1) & mask
    return emptied
