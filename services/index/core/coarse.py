"""The coarse quantizer that every shard of an index shares: assign once, probe everywhere.

Each shard of an IVF index holds the same trained centroids, so assigning a query to its
inverted lists gives the same answer on every shard. The router therefore assigns a wave
of queries once and sends the assignment (:class:`Probes`) with the search; the shards
then scan their lists directly (FAISS ``search_preassigned``, the pattern of FAISS's own
``IndexShardsIVF``). Measured on the SciFact bench index (884 lists, 15-query batches,
nprobe 64): a shard's search takes 87 instead of 117 µs per query, with identical
results. A probe set names the quantizer it came from; a shard with other centroids
refuses it (FailedPrecondition) rather than scan the wrong lists.
"""

from __future__ import annotations

import hashlib

import faiss
import numpy as np

from services.common.errors import FailedPrecondition, InvalidArgument
from services.index.core.query import Probes


def quantizer_id(centroids: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(centroids, dtype="<f4").tobytes()).hexdigest()[:16]


def set_threads(threads: int) -> None:
    """OpenMP threads of the assignments made on the calling thread (OpenMP's count is
    per thread; its default, every core, leaves idle workers spinning after each wave)."""
    faiss.omp_set_num_threads(threads)


class CoarseQuantizer:
    """``CoarseQuantizer(centroids, "IP", default_nprobe).assign(queries, nprobe)``."""

    def __init__(self, centroids: np.ndarray, metric: str, default_nprobe: int) -> None:
        centroids = np.ascontiguousarray(centroids, dtype=np.float32)
        if centroids.ndim != 2 or len(centroids) == 0:
            raise ValueError(f"centroids: expected (nlist, dim), got {centroids.shape}")
        if metric not in ("IP", "L2"):
            raise ValueError(f"metric: {metric!r} is neither IP nor L2")
        self.centroids = centroids
        self.metric = metric
        self.nlist, self.dim = centroids.shape
        self.default_nprobe = default_nprobe
        self.id = quantizer_id(centroids)
        self._flat = faiss.IndexFlatIP(self.dim) if metric == "IP" else faiss.IndexFlatL2(self.dim)
        self._flat.add(centroids)

    @classmethod
    def of_ivf(cls, ivf: faiss.IndexIVF, metric: str, default_nprobe: int) -> CoarseQuantizer:
        centroids = ivf.quantizer.reconstruct_n(0, ivf.nlist)
        return cls(centroids, metric, default_nprobe)

    def assign(self, queries: np.ndarray, nprobe: int = 0) -> Probes:
        """The ``nprobe`` (0 = the default) best lists of each query, best first."""
        nprobe = min(nprobe or self.default_nprobe, self.nlist)
        scores, lists = self._flat.search(np.ascontiguousarray(queries, dtype=np.float32), nprobe)
        return Probes(self.id, lists, scores)

    def check(self, probes: Probes, rows: int) -> None:
        """Raise unless ``probes`` fits ``rows`` queries of this quantizer."""
        if probes.quantizer != self.id:
            raise FailedPrecondition(
                f"probes: made with quantizer {probes.quantizer!r}, this shard's is {self.id!r}"
            )
        shape = (rows, probes.nprobe)
        if probes.lists.shape != shape or probes.scores.shape != shape:
            raise InvalidArgument(
                f"probes: lists {probes.lists.shape} / scores {probes.scores.shape}, "
                f"expected {rows} rows of the same width"
            )
        if not 1 <= probes.nprobe <= self.nlist:
            raise InvalidArgument(f"probes: nprobe {probes.nprobe} is out of range 1..{self.nlist}")
        if probes.lists.min() < 0 or probes.lists.max() >= self.nlist:
            raise InvalidArgument(f"probes: list numbers must be in 0..{self.nlist - 1}")
        if not np.isfinite(probes.scores).all():
            raise InvalidArgument("probes: NaN or Inf scores")
