"""One shard of the IVF-PQ index, in memory: apply changes, search, report.

No grpc and no Redis here: :mod:`services.index.server.replica` feeds it from the log and
:mod:`services.index.server.servicer` exposes it. Thread-safe: searches take a read lock and
run in parallel (FAISS releases the GIL); a batch of changes takes the write lock.

Storage per vector: the IVF-PQ code (``pq_m`` bytes) and its id (8 bytes) in the
inverted lists, an SQ8 code (``dim`` bytes) for the refine stage, the direct map entry.
Removes go through the direct map (hash table id → list/offset), never a scan.

Beside the vectors, optionally, the shard's BM25 text index (:mod:`.text`): every batch
of changes reaches both under the same write lock, the vectors searchable at once and
the text staged in Tantivy's writer (``staged`` moves). The text becomes searchable at a
refresh (:meth:`IvfPqShard.refresh`: a Tantivy commit, ~10 ms of CPU whatever the batch),
which runs outside the write lock, so searches never wait for it; ``applied`` moves
only then, so a position the shard reports applied is searchable densely and sparsely.
``apply(..., refresh=True)`` (the default) refreshes at once; the log consumer batches
refreshes instead (:mod:`services.index.server.replica`, docs/index.md "The text
index's refresh"). Snapshots carry both, refreshed first (``export_state``).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import faiss
import numpy as np

from services.common import positions
from services.common.errors import FailedPrecondition, InvalidArgument
from services.common.limits import LIMITS
from services.index.core.changes import Change, Delete, Upsert
from services.index.core.coarse import CoarseQuantizer
from services.index.core.gpu import GpuMirror
from services.index.core.ids import faiss_id
from services.index.core.pq_drift import PqDrift
from services.index.core.query import PAD_ID, FilterSpec, Probes, Scored, TopK
from services.index.core.rwlock import RWLock
from services.index.core.scan import refine, search_preassigned
from services.index.core.slots import SlotTable
from services.index.core.tags import TagPostings, check_filter
from services.index.core.text import TextDoc, TextIndex, TextStats
from services.index.core.trained import TrainedIndex

log = logging.getLogger(__name__)

MAX_K = LIMITS.max_k
MAX_QUERIES = LIMITS.max_shard_queries


@dataclass(frozen=True)
class ApplyResult:
    added: int
    removed: int
    position: str


@dataclass(frozen=True)
class ShardStats:
    vectors: int
    deleted: int
    applied_position: str
    bytes_per_vector: float
    memory_bytes: int
    train_pq_error: float
    recent_pq_error: float
    pq_error_ratio: float
    list_imbalance: float
    text: TextStats | None = None  # None: this replica has no text index


def check_queries(queries: np.ndarray, dim: int) -> np.ndarray:
    if queries.ndim != 2 or queries.shape[1] != dim:
        got = queries.shape[1] if queries.ndim == 2 else queries.shape
        raise InvalidArgument(f"queries: dimension {got}, the index has {dim}")
    if not 1 <= queries.shape[0] <= MAX_QUERIES:
        raise InvalidArgument(f"queries: {queries.shape[0]} vectors, takes 1..{MAX_QUERIES}")
    if not np.isfinite(queries).all():
        raise InvalidArgument("queries: NaN or Inf values")
    return np.ascontiguousarray(queries, dtype=np.float32)


def _without_collisions(
    last: dict[str, Change], fids: dict[str, int]
) -> tuple[dict[str, Change], dict[str, int]]:
    """Of the changes of one batch whose FAISS ids collide, the last one wins (logged)."""
    winner: dict[int, str] = {}
    for doc_id, fid in fids.items():
        if fid in winner:
            log.error("63-bit id collision: %r replaces %r", doc_id, winner[fid])
        winner[fid] = doc_id
    keep = set(winner.values())
    return (
        {d: c for d, c in last.items() if d in keep},
        {d: f for d, f in fids.items() if d in keep},
    )


@dataclass(frozen=True)
class VectorExport:
    """What :meth:`IvfPqShard.export_codes` copied: ids, their SQ8 codes, the position."""

    ids: list[str]
    codes: np.ndarray  # uint8 (n, code_size)
    position: str
    codec: faiss.Index  # the trained SQ8 index (an IndexScalarQuantizer): decodes codes

    def __len__(self) -> int:
        return len(self.ids)

    def vectors(self, start: int, stop: int) -> np.ndarray:
        """The decoded float32 vectors of ``ids[start:stop]``: within half a quantization
        step (per dimension: its trained range / 255) of the vectors that were added."""
        return np.asarray(self.codec.sa_decode(self.codes[start:stop]), dtype=np.float32)


class IvfPqShard:
    def __init__(self, trained: TrainedIndex, text: TextIndex | None = None) -> None:
        self.manifest = trained.manifest
        self.dim = trained.manifest.dim
        self.index = faiss.clone_index(trained.index)
        self.ivf = faiss.extract_index_ivf(self.index)
        self.ivf.set_direct_map_type(faiss.DirectMap.Hashtable)  # type: ignore[attr-defined]
        self._refine_index = trained.refine  # owns the SQ8 codec that self.sq points into
        self.sq = trained.sq
        self.code_size = int(self.sq.code_size)
        # per slot: the SQ8 code and the document id (None when free)
        self._codes = np.zeros((0, self.code_size), dtype=np.uint8)
        self._docs = np.full(0, None, dtype=object)
        self._used = 0
        self._reserve(1024)
        self._slots = SlotTable()  # FAISS id → slot
        self._free: list[int] = []
        self._tags = TagPostings()
        self._drift = PqDrift()
        self.applied = positions.ZERO  # searchable densely and sparsely
        self.staged = positions.ZERO  # in the vectors; in the text once refreshed
        self.deleted_total = 0
        self.lock = RWLock()
        # Held by a batch of changes around the write lock, and by a GPU copy instead of
        # it: a copy keeps writers out but lets searches run (they only read).
        self._writes = threading.Lock()
        self.text = text  # the BM25 index, kept in step with the vectors (None: dense only)
        self.gpu: GpuMirror | None = None
        # the trained centroids, for callers that assign queries once for all shards
        m = self.manifest
        self.quantizer = CoarseQuantizer.of_ivf(self.ivf, m.metric, m.nprobe)

    def attach_gpu(self, mirror: GpuMirror) -> None:
        """Serve unfiltered searches from ``mirror`` (a GPU copy kept in step from now on).

        Writers wait for the copy; searches go on (from the CPU index) meanwhile.
        """
        with self._writes:
            mirror.sync(self.index, self._writes)
            self.gpu = mirror

    # --- writes ----------------------------------------------------------------------

    def apply(self, changes: Sequence[Change], position: str, refresh: bool = True) -> ApplyResult:
        """Apply a batch in log order: per id the last change wins; upsert = remove + add.

        ``refresh``: make the text searchable before returning (else it waits for the next
        :meth:`refresh`, and ``applied`` with it)."""
        last: dict[str, Change] = {}
        for change in changes:
            last.pop(change.doc_id, None)  # keep insertion order = order of last change
            last[change.doc_id] = change
        fids = {doc_id: faiss_id(doc_id) for doc_id in last}
        if len(set(fids.values())) < len(fids):
            last, fids = _without_collisions(last, fids)
        upserts = [c for c in last.values() if isinstance(c, Upsert)]
        vectors = (
            np.stack([np.asarray(u.vector, dtype=np.float32) for u in upserts])
            if upserts
            else np.zeros((0, self.dim), dtype=np.float32)
        )
        if len(vectors) and (vectors.shape[1] != self.dim or not np.isfinite(vectors).all()):
            # The gateway validates before logging; a bad entry here means a foreign writer.
            raise InvalidArgument(
                f"log entry at {position}: vectors must be finite, dim {self.dim}"
            )
        with self._writes:
            with self.lock.write():
                removed = self._apply_locked(last, fids, upserts, vectors, position)
            if refresh:  # outside the write lock: searches go on meanwhile
                self.refresh_held()
        if upserts:
            self._drift.track(self.index, vectors)
        return ApplyResult(added=len(upserts), removed=removed, position=self.applied)

    def _apply_locked(
        self,
        last: dict[str, Change],
        fids: dict[str, int],
        upserts: list[Upsert],
        vectors: np.ndarray,
        position: str,
    ) -> int:
        """The batch into the vectors, the tags and (staged) the text; the ids removed."""
        present = self._present(fids)
        removed = self._remove(sorted(present))
        self.deleted_total += sum(
            1 for d, c in last.items() if isinstance(c, Delete) and fids[d] in present
        )
        if upserts:
            self._add(upserts, vectors, [fids[u.doc_id] for u in upserts])
        if self.text is not None and last:
            # Every id of the batch is deleted by term first (an upsert replaces, a
            # delete of an absent id deletes nothing), then the upserts are added.
            # Searchable at the refresh; until then search_text drops the hits of ids
            # no longer held (a delete never comes back), and an upserted id is found
            # by its old text, as in any near-real-time index.
            self.text.stage(
                fids.values(),
                [TextDoc(fids[u.doc_id], u.body, u.tags) for u in upserts],
            )
        if self.gpu is not None:  # in step incrementally; never raises (CPU fallback)
            if present:
                self.gpu.remove(np.asarray(sorted(present), dtype=np.int64))
            if upserts:
                ids = np.asarray([fids[u.doc_id] for u in upserts], dtype=np.int64)
                self.gpu.add(vectors, ids)
            if self.gpu.needs_rebuild():
                self.gpu.start_rebuild(self.index, self._writes)
        if positions.parse(position) > positions.parse(self.staged):
            self.staged = position
        if self.text is None:
            self.applied = self.staged
        return removed

    @property
    def pending(self) -> bool:
        """Changes applied to the vectors whose text is not searchable yet."""
        return self.staged != self.applied

    def refresh(self) -> None:
        """Make the staged text searchable and move ``applied`` to ``staged``. Holds the
        writers out (no batch is half in a commit), not the searches."""
        with self._writes:
            self.refresh_held()

    def writers(self) -> AbstractContextManager[Any]:
        """Held: no batch is applied meanwhile (searches go on); with it held, call
        :meth:`refresh_held`, not :meth:`refresh`."""
        return self._writes

    def refresh_held(self) -> None:
        """:meth:`refresh` for a caller that holds :meth:`writers`."""
        if self.text is not None:
            self.text.refresh()
        self.applied = self.staged

    def _present(self, fids: dict[str, int]) -> set[int]:
        """The ids of ``fids`` (doc id → FAISS id) held here; a collision is logged."""
        ids = np.fromiter(fids.values(), dtype=np.int64, count=len(fids))
        slots = self._slots.lookup(ids)
        present: set[int] = set()
        for doc_id, fid, slot in zip(fids, ids.tolist(), slots.tolist(), strict=True):
            if slot >= 0:
                present.add(fid)
                if self._docs[slot] != doc_id:
                    log.error("63-bit id collision: %r replaces %r", doc_id, self._docs[slot])
        return present

    def _remove(self, fids: list[int]) -> int:
        if not fids:
            return 0
        ids = np.asarray(fids, dtype=np.int64)
        removed = int(self.index.remove_ids(faiss.IDSelectorArray(ids.size, faiss.swig_ptr(ids))))
        slots = self._slots.remove(ids)
        self._docs[slots] = None
        self._free.extend(slots.tolist())
        self._tags.remove(fids)
        return removed

    def _add(self, upserts: list[Upsert], vectors: np.ndarray, fids: list[int]) -> None:
        ids = np.asarray(fids, dtype=np.int64)
        self.index.add_with_ids(vectors, ids)
        slots = np.array([self._take_slot() for _ in upserts], dtype=np.int64)
        self._codes[slots] = self.sq.compute_codes(vectors)
        self._docs[slots] = [u.doc_id for u in upserts]
        self._slots.add(ids, slots)
        for upsert, fid in zip(upserts, fids, strict=True):
            self._tags.add(fid, upsert.tags)

    def _take_slot(self) -> int:
        if self._free:
            return self._free.pop()
        if self._used == len(self._codes):
            self._reserve(2 * len(self._codes))
        self._used += 1
        return self._used - 1

    def _reserve(self, capacity: int) -> None:
        """Grow the per-slot arrays (codes, doc ids) to ``capacity``, keeping used slots."""
        codes = np.zeros((capacity, self.code_size), dtype=np.uint8)
        codes[: self._used] = self._codes[: self._used]
        docs = np.full(capacity, None, dtype=object)
        docs[: self._used] = self._docs[: self._used]
        self._codes, self._docs = codes, docs

    # --- reads -----------------------------------------------------------------------

    def search(
        self,
        queries: np.ndarray,
        k: int,
        nprobe: int = 0,
        filter: FilterSpec = (),
    ) -> list[list[Scored]]:
        """Top-k (doc id, score) per query, best first; fewer when fewer documents match."""
        return self.search_top_k(queries, k, nprobe, filter).hits()

    def search_top_k(
        self,
        queries: np.ndarray,
        k: int,
        nprobe: int = 0,
        filter: FilterSpec = (),
        probes: Probes | None = None,
        *,
        checked: bool = False,
    ) -> TopK:
        """:meth:`search` as a ``(queries, k)`` grid, padded where fewer documents match.

        ``probes``: the coarse assignment made by the caller (:mod:`.coarse`); it then
        decides the lists scanned (and ``nprobe`` is theirs). ``checked``: the caller
        has validated the request already (the batcher, for the shard service).
        """
        if not checked:
            queries = self.check(queries, k, nprobe, filter, probes)
        nprobe = nprobe or self.manifest.nprobe
        with self.lock.read():
            selector = self._tags.selector(filter)
            if selector is None and filter:
                return TopK.empty(len(queries), k)
            fetch = k * self.manifest.refine_factor if self.manifest.refine else k
            if self.gpu is not None and selector is None:
                scores, ids = self.gpu.search(queries, fetch, probes.nprobe if probes else nprobe)
            elif probes is not None:
                scores, ids = search_preassigned(self.ivf, queries, fetch, probes, selector)
            else:
                params = faiss.SearchParametersIVF(nprobe=nprobe)  # type: ignore[call-arg]
                if selector is not None:
                    params.sel = selector
                scores, ids = self.index.search(queries, fetch, params=params)
            slots = self._slots.lookup(ids)
            if self.manifest.refine:
                slots, scores = refine(self.sq, self._codes, queries, slots, k)
            else:
                scores = np.where(slots >= 0, scores, np.float32(-np.inf)).astype(np.float32)
            names = np.where(slots >= 0, self._docs[np.maximum(slots, 0)], PAD_ID)
            return TopK(names.ravel().tolist(), scores)

    def search_text(self, terms: Sequence[Sequence[str]], k: int, filter: FilterSpec = ()) -> TopK:
        """BM25 top-``k`` of each query (its analysed terms: :meth:`query_terms`) as a
        ``(queries, k)`` grid; a query of no term has no hits. FailedPrecondition when
        this shard has no text index."""
        text = self._text_index()
        with self.lock.read():
            found = text.search(terms, k, filter)
            slots = self._slots.lookup(found.fids)
            scores = np.where(slots >= 0, found.scores, np.float32(-np.inf)).astype(np.float32)
            names = np.where(slots >= 0, self._docs[np.maximum(slots, 0)], PAD_ID)
            return TopK(names.ravel().tolist(), scores)

    def query_terms(self, texts: Sequence[str]) -> list[list[str]]:
        """Each query text's distinct analysed terms (InvalidArgument past the limit)."""
        text = self._text_index()
        return [text.terms(t) for t in texts]

    def _text_index(self) -> TextIndex:
        if self.text is None:
            raise FailedPrecondition(
                "this shard replica has no text index (its snapshot predates hybrid "
                "retrieval, or it runs with --no-text-index): it serves dense searches only"
            )
        return self.text

    def check_vector(self, vector: np.ndarray) -> None:
        """InvalidArgument unless ``vector`` is a finite vector of the index dimension."""
        v = np.asarray(vector)
        if v.shape != (self.dim,):
            raise InvalidArgument(f"vector: shape {v.shape}, the index has dimension {self.dim}")
        if not np.isfinite(v).all():
            raise InvalidArgument("vector: NaN or Inf values")

    def check(
        self,
        queries: np.ndarray,
        k: int,
        nprobe: int,
        filter: FilterSpec = (),
        probes: Probes | None = None,
    ) -> np.ndarray:
        """The one check of a search (InvalidArgument, or FailedPrecondition for probes of
        other centroids); the queries as contiguous float32."""
        queries = self.validate(queries, k, nprobe)
        self.check_filter(filter)
        if probes is not None:
            self.quantizer.check(probes, len(queries))
        return queries

    def validate(self, queries: np.ndarray, k: int, nprobe: int) -> np.ndarray:
        """InvalidArgument for a bad search; the queries as contiguous float32."""
        queries = check_queries(queries, self.dim)
        if not 1 <= k <= MAX_K:
            raise InvalidArgument(f"k: {k} is out of range 1..{MAX_K}")
        if not 0 <= nprobe <= int(self.ivf.nlist):
            raise InvalidArgument(f"nprobe: {nprobe} exceeds nlist {int(self.ivf.nlist)}")
        return queries

    @staticmethod
    def check_filter(filter: FilterSpec) -> None:
        """InvalidArgument for a filter past the limits (:func:`.tags.check_filter`)."""
        check_filter(filter)

    # --- state -----------------------------------------------------------------------

    def __len__(self) -> int:
        return int(self.index.ntotal)

    def contains(self, doc_id: str) -> bool:
        return faiss_id(doc_id) in self._slots

    def doc_ids(self) -> Iterable[str]:
        return [d for d in self._docs[: self._used].tolist() if d is not None]

    def stats(self) -> ShardStats:
        with self.lock.read():
            n = int(self.index.ntotal)
            invlists: Any = self.ivf.invlists
            in_lists = self.manifest.pq_m + 8  # PQ code and id, in the inverted lists
            per_vector = in_lists + (self.code_size if self.manifest.refine else 0)
            memory = int(
                n * in_lists
                + self.ivf.nlist * self.dim * 4  # centroids
                + self._codes.nbytes  # SQ8 codes, by slot (allocated capacity)
                + self._docs.nbytes  # string id references, by slot
                + self._slots.nbytes  # FAISS id → slot
            )
            sizes = np.array(
                [invlists.list_size(i) for i in range(self.ivf.nlist)], dtype=np.float64
            )
        total = sizes.sum()
        imbalance = float((sizes**2).sum() * len(sizes) / total**2) if total else 1.0
        recent = self._drift.mean
        train = self.manifest.train_pq_error
        return ShardStats(
            text=self.text.stats() if self.text is not None else None,
            vectors=n,
            deleted=self.deleted_total,
            applied_position=self.applied,
            bytes_per_vector=float(per_vector),
            memory_bytes=memory,
            train_pq_error=train,
            recent_pq_error=recent,
            pq_error_ratio=recent / train if train and self._drift.count else math.nan,
            list_imbalance=imbalance,
        )

    def export_codes(self) -> VectorExport:
        """Every id this shard holds with its SQ8 code, copied at once under the read lock,
        and the position they stand at (a rollout's ``--retrain`` reads the stored vectors
        through :meth:`VectorExport.vectors`, docs/generations.md). Costs a copy of the
        codes (``dim`` bytes a vector), as a snapshot does."""
        with self.lock.read():
            _, slots = self._slots.items()
            return VectorExport(
                self._docs[slots].tolist(),
                self._codes[slots].copy(),
                self.applied,
                self._refine_index,
            )
