"""A shard's metadata tags: the postings (tag → FAISS ids) a filtered search selects by,
and the check of a filter against the limits.
"""

from __future__ import annotations

from collections.abc import Iterable

import faiss
import numpy as np

from services.common.errors import InvalidArgument
from services.common.limits import LIMITS
from services.index.core.query import FilterSpec

MAX_FILTER_KEY_BYTES = LIMITS.max_key_bytes
MAX_FILTER_VALUES = LIMITS.max_filter_values

Tag = tuple[str, str]


def check_filter(filter: FilterSpec) -> None:
    """InvalidArgument for a filter past the limits (key bytes, values per key)."""
    for key, values in filter:
        if not key or len(key.encode("utf-8")) > MAX_FILTER_KEY_BYTES:
            raise InvalidArgument(f"filter: key {key!r} must be 1..{MAX_FILTER_KEY_BYTES} bytes")
        if not 1 <= len(values) <= MAX_FILTER_VALUES:
            raise InvalidArgument(
                f"filter: key {key!r} has {len(values)} values, takes 1..{MAX_FILTER_VALUES}"
            )


class TagPostings:
    """Each id's tags and each tag's ids (the shard's write lock guards the changes)."""

    def __init__(self) -> None:
        self._tags: dict[int, tuple[Tag, ...]] = {}
        self._postings: dict[Tag, set[int]] = {}

    def add(self, fid: int, tags: dict[str, str]) -> None:
        """Record ``fid``'s tags (sorted; none: nothing recorded)."""
        ordered = tuple(sorted(tags.items()))
        if ordered:
            self._tags[fid] = ordered
            for tag in ordered:
                self._postings.setdefault(tag, set()).add(fid)

    def remove(self, fids: Iterable[int]) -> None:
        for fid in fids:
            for tag in self._tags.pop(fid, ()):
                bucket = self._postings.get(tag)
                if bucket is not None:
                    bucket.discard(fid)
                    if not bucket:
                        del self._postings[tag]

    def of(self, fid: int) -> dict[str, str]:
        """``fid``'s tags (empty when it has none)."""
        return dict(self._tags.get(fid, ()))

    def selector(self, filter: FilterSpec) -> faiss.IDSelector | None:
        """The ids that match every key of ``filter`` (one of its values each); None for
        no filter, or for a filter nothing matches (the caller tells them apart)."""
        if not filter:
            return None
        allowed: set[int] | None = None
        for key, values in filter:
            matching: set[int] = set()
            for value in values:
                matching |= self._postings.get((key, value), set())
            allowed = matching if allowed is None else allowed & matching
            if not allowed:
                return None
        assert allowed is not None
        return faiss.IDSelectorBatch(np.fromiter(allowed, dtype=np.int64, count=len(allowed)))
