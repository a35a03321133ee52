"""The stale entries of a GPU copy, dropped in one vectorised pass.

faiss-gpu's IVF indexes have no ``remove_ids`` (:mod:`.gpu`), so the copy keeps an entry
for every id removed since it was made: that entry is *stale*, and a search drops it. An
id added again goes into the copy under an *alias*, a fresh 63-bit id, so its old entry
(under the id) and its new one (under the alias) are told apart by id alone: the old one
is dropped with the other stale entries, the new one is mapped back to the id, and its
score is the copy's own, as for every other entry. Nothing is reconstructed or re-scored
on the CPU, and the grid keeps the copy's order (stale entries squeezed out, a stable
sort on a boolean). The sets are sorted id arrays, replaced (never changed in place) by
the writers, so a search reads the ones it copied under the mirror's lock and runs this
outside it, under the shard's read lock only.

An alias is random (seeded) in the 63-bit range of FAISS ids (:mod:`.ids`), so it could
equal a document's id with the probability of a 63-bit collision; an add of such an id
is refused by :meth:`StaleIds.added` (``AliasCollision``) and the mirror rebuilds the
copy, which needs no aliases.

Issue #37 item 3: the loop this replaces (one ``reconstruct`` per stale hit, in Python,
under the mirror's lock) cost 17 ms per 32-query batch at k=10 and 97 ms at k=100 in the
issue (768-d, 2 % stale). Measured here (``python -m bench.gpu_stale``,
``bench/results/gpu_stale.json``: 20,000 vectors, 768-d, 2 % stale, 32 queries, the
shard's fetch of 4k; a CPU clone stands in for the GPU copy): this step 0.12 ms
at k=10 and 0.73 ms at k=100, the old loop on the same batch 0.90 and
8.08 ms; a whole search with stale entries 1.10x and 1.16x the
same search on a fresh copy (target 1.2x).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

_ID_LIMIT = 1 << 63  # FAISS ids are 63-bit (services/index/core/ids.py)


class AliasCollision(Exception):
    """An id to add equals a live alias (a 63-bit collision): rebuild the copy."""


@dataclass(frozen=True)
class StaleIds:
    """The copy's stale ids (sorted: ids and aliases whose entries no search may return)
    and its live aliases (sorted by alias, with the id each stands for; and by id)."""

    stale: np.ndarray
    alias: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    alias_of: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    seed: int = 0  # the next aliases' random stream

    @classmethod
    def none(cls) -> StaleIds:
        return cls(np.empty(0, dtype=np.int64))

    def removed(self, ids: np.ndarray) -> StaleIds:
        """``ids`` left the CPU index: their entries in the copy (under an alias, for ids
        added again since the copy was made) are stale from now on."""
        ids = ids.astype(np.int64)
        aliased = members(np.sort(self.alias_of), ids)
        keep = ~members(np.sort(ids), self.alias_of)
        gone = self.alias[~keep]
        stale = np.union1d(self.stale, np.concatenate([ids[~aliased], gone]))
        return StaleIds(stale, self.alias[keep], self.alias_of[keep], self.seed)

    def added(self, ids: np.ndarray) -> tuple[StaleIds, np.ndarray]:
        """The sets after adding ``ids``, and the ids to add them under in the copy: a
        fresh alias for every id the copy already holds an (old) entry of."""
        ids = ids.astype(np.int64)
        if members(self.alias, ids).any():
            raise AliasCollision("an added id equals a live alias")
        again = members(self.stale, ids)
        if not again.any():
            return self, ids
        rng = np.random.default_rng(self.seed)
        fresh = rng.integers(0, _ID_LIMIT, int(again.sum()), dtype=np.int64)
        as_copy = ids.copy()
        as_copy[again] = fresh
        alias = np.concatenate([self.alias, fresh])
        alias_of = np.concatenate([self.alias_of, ids[again]])
        order = np.argsort(alias, kind="stable")
        return StaleIds(self.stale, alias[order], alias_of[order], self.seed + 1), as_copy

    @cached_property
    def _stale_bits(self) -> np.ndarray:
        return _bitmap(self.stale)

    @cached_property
    def _alias_bits(self) -> np.ndarray:
        return _bitmap(self.alias)

    def mask(self, ids: np.ndarray) -> np.ndarray:
        """Which of ``ids`` (any shape) are stale."""
        if self.stale.size == 0:
            return np.zeros(ids.shape, dtype=bool)
        return _lookup(self.stale, self._stale_bits, ids)

    def real(self, ids: np.ndarray) -> np.ndarray:
        """``ids`` (any shape) with every live alias replaced by the id it stands for."""
        if self.alias.size == 0:
            return ids
        hit = _lookup(self.alias, self._alias_bits, ids)
        if not hit.any():
            return ids
        out = ids.copy()
        out[hit] = self.alias_of[np.searchsorted(self.alias, ids[hit])]
        return out


def _bitmap(sorted_ids: np.ndarray) -> np.ndarray:
    """A bitmap of the ids' low bits (FAISS ids and aliases are hashes: uniform), 8 slots
    per id or more, from 4,096 to 4 M: most ids of a grid are ruled out by one lookup, and
    only the few that pass are searched for (a binary search per id of a 32 x 416 grid
    cost 0.4 ms, as much as the rest of the step)."""
    size = 1 << max(12, min(22, (8 * len(sorted_ids)).bit_length()))
    bits = np.zeros(size, dtype=bool)
    bits[sorted_ids & (size - 1)] = True
    return bits


def _lookup(sorted_ids: np.ndarray, bits: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Which of ``ids`` are in ``sorted_ids`` (``bits`` its :func:`_bitmap`)."""
    maybe = bits[ids & (bits.size - 1)]
    if maybe.any():
        maybe[maybe] = members(sorted_ids, ids[maybe])
    return np.asarray(maybe)


def members(sorted_ids: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """A mask of ``ids`` (any shape) that are in ``sorted_ids``."""
    if sorted_ids.size == 0:
        return np.zeros(ids.shape, dtype=bool)
    at = np.minimum(np.searchsorted(sorted_ids, ids), sorted_ids.size - 1)
    return np.asarray(sorted_ids[at] == ids)


def drop_stale(
    scores: np.ndarray, ids: np.ndarray, k: int, sets: StaleIds, ascending: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """The top-``k`` of an over-fetched ``(scores, ids)`` grid of the copy (sorted by the
    copy), without its stale entries and with aliases mapped back to their ids; padded
    with -1 (and the metric's worst score: ``ascending`` for L2) where fewer remain."""
    dead = sets.mask(ids)
    ids = sets.real(ids)
    if not dead.any():
        return scores[:, :k], ids[:, :k]
    pad = np.float32(np.inf if ascending else -np.inf)
    rows = np.flatnonzero(dead.any(axis=1))  # only these rows' entries move
    order = np.argsort(dead[rows], axis=1, kind="stable")[:, :k]  # live first, in order
    line = np.arange(rows.size)[:, None]
    gone = dead[rows][line, order]
    top_scores, top_ids = scores[:, :k].copy(), ids[:, :k].copy()
    top_scores[rows] = np.where(gone, pad, scores[rows][line, order])
    top_ids[rows] = np.where(gone, -1, ids[rows][line, order])
    return top_scores, top_ids
