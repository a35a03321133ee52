"""The stale entries of a GPU copy, dropped or re-scored in one vectorised pass.

faiss-gpu's IVF indexes have no ``remove_ids`` (:mod:`.gpu`), so the copy keeps an entry
for every id removed since it was made (*stale*): a deleted id's entry must be dropped;
an id added again has its old entry and its new one, both scored here from the CPU
index's current code (``reconstruct_batch``: one faiss call for every such id of the
batch), one hit kept per id. The mirror's sets are sorted id arrays, replaced (never
changed in place) by the writers, so a search reads the ones it copied under the mirror's
lock and runs this outside it, under the shard's read lock only.

Issue #37 item 3, measured (``python -m bench.gpu_stale``, ``bench/results/gpu_stale.json``):
the loop this replaces (one ``reconstruct`` per stale hit, in Python, under the mirror's
lock) cost 17 ms per 32-query batch at k=10 and 97 ms at k=100 (768-d, 2 % stale).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import faiss
import numpy as np


@dataclass(frozen=True)
class StaleIds:
    """The copy's stale ids (sorted) and those of them the CPU index holds again (sorted)."""

    stale: np.ndarray
    live: np.ndarray

    @classmethod
    def none(cls) -> StaleIds:
        empty = np.empty(0, dtype=np.int64)
        return cls(empty, empty)

    def removed(self, ids: np.ndarray) -> StaleIds:
        """``ids`` left the CPU index: stale, and no longer live."""
        ids = ids.astype(np.int64)
        return StaleIds(np.union1d(self.stale, ids), np.setdiff1d(self.live, ids))

    def added(self, ids: np.ndarray) -> StaleIds:
        """``ids`` were added to the CPU index (and to the copy): the stale ones are live."""
        back = np.intersect1d(ids.astype(np.int64), self.stale)
        return self if back.size == 0 else StaleIds(self.stale, np.union1d(self.live, back))

    @cached_property
    def _bits(self) -> np.ndarray:
        """A bitmap of the stale ids' low bits (FAISS ids are hashes: uniform), 8 slots
        per id or more, from 4,096 to 4 M: most ids of a grid are ruled out by one
        lookup, and only the few that pass are searched for in ``stale`` (a binary search
        per id of a 32 x 416 grid cost 0.4 ms, as much as the rest of the step)."""
        size = 1 << max(12, min(22, (8 * len(self.stale)).bit_length()))
        bits = np.zeros(size, dtype=bool)
        bits[self.stale & (size - 1)] = True
        return bits

    def mask(self, ids: np.ndarray) -> np.ndarray:
        """Which of ``ids`` (any shape) are stale."""
        if self.stale.size == 0:
            return np.zeros(ids.shape, dtype=bool)
        bits = self._bits
        maybe = bits[ids & (bits.size - 1)]
        if maybe.any():
            maybe[maybe] = members(self.stale, ids[maybe])
        return maybe


def members(sorted_ids: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """A mask of ``ids`` (any shape) that are in ``sorted_ids``."""
    if sorted_ids.size == 0:
        return np.zeros(ids.shape, dtype=bool)
    at = np.minimum(np.searchsorted(sorted_ids, ids), sorted_ids.size - 1)
    return np.asarray(sorted_ids[at] == ids)


def drop_stale(
    queries: np.ndarray,
    scores: np.ndarray,
    ids: np.ndarray,
    k: int,
    sets: StaleIds,
    cpu: faiss.Index,
) -> tuple[np.ndarray, np.ndarray]:
    """The top-``k`` of an over-fetched ``(scores, ids)`` grid of the copy, without its
    stale entries: removed ids dropped, re-added ids scored from ``cpu``'s codes, one hit
    per id; padded with -1 (and the metric's worst score) where fewer remain."""
    is_stale = sets.mask(ids)
    if not is_stale.any():
        return scores[:, :k], ids[:, :k]
    ascending = cpu.metric_type == faiss.METRIC_L2
    pad = np.float32(np.inf if ascending else -np.inf)
    rows, cols = np.nonzero(is_stale)
    found = ids[rows, cols]
    live = members(sets.live, found)
    out_ids, out_scores = ids.copy(), scores.astype(np.float32)
    out_ids[rows[~live], cols[~live]] = -1  # removed from the CPU index: dropped
    out_scores[rows[~live], cols[~live]] = pad
    rows, cols, found = rows[live], cols[live], found[live]
    if rows.size:
        keys = np.unique(found)
        v = cpu.reconstruct_batch(keys)[np.searchsorted(keys, found)]  # the current codes
        q = queries[rows]
        fresh = np.sum((q - v) ** 2, axis=1) if ascending else np.einsum("ij,ij->i", q, v)
        out_scores[rows, cols] = fresh
        # one hit per id: the old and the new entry now score alike; the later one goes
        order = np.lexsort((cols, found, rows))
        r, f = rows[order], found[order]
        repeat = order[1:][(r[1:] == r[:-1]) & (f[1:] == f[:-1])]
        out_ids[rows[repeat], cols[repeat]] = -1
        out_scores[rows[repeat], cols[repeat]] = pad
    touched = np.unique(np.nonzero(is_stale)[0])  # only these rows' order changed
    sub = out_scores[touched]
    order = np.argsort(sub if ascending else -sub, axis=1, kind="stable")[:, :k]
    top_ids, top_scores = out_ids[:, :k].copy(), out_scores[:, :k].copy()
    top_scores[touched] = np.take_along_axis(sub, order, axis=1)
    top_ids[touched] = np.take_along_axis(out_ids[touched], order, axis=1)
    return top_scores, np.where(top_scores == pad, -1, top_ids)
