"""Optional GPU serving: a GPU copy of a shard's IVF-PQ, kept in step with the CPU index.

The CPU index stays the source of truth (snapshots, removes, filtered searches); the GPU
copy serves unfiltered searches with float16 lookup tables. Adds go to both; a batch
that removes anything re-copies the CPU index to the GPU (GPU IVF indexes have no
direct map, so removes there would be a scan). On a machine without a GPU (or with the
faiss-cpu build) :func:`gpu_status` says why and nothing else changes.
"""

from __future__ import annotations

import logging
from typing import Any

import faiss
import numpy as np

log = logging.getLogger(__name__)


def gpu_status() -> tuple[bool, str]:
    """(usable, reason): whether searches can be served from a GPU, and why (not)."""
    if not hasattr(faiss, "StandardGpuResources"):
        return False, "this faiss build has no GPU support (faiss-cpu)"
    count = int(faiss.get_num_gpus())
    if count == 0:
        return False, "faiss sees no GPU device"
    return True, f"{count} GPU(s) visible to faiss"


class GpuMirror:
    """A GPU copy of one IVF-PQ index on ``device``."""

    def __init__(self, device: int = 0) -> None:
        gpu: Any = faiss
        self.device = device
        self._resources = gpu.StandardGpuResources()
        self._options = gpu.GpuClonerOptions()
        self._options.useFloat16LookupTables = True
        self._options.indicesOptions = gpu.INDICES_64_BIT
        self.index: Any = None

    def sync(self, cpu_index: faiss.Index) -> None:
        """Replace the GPU copy with a fresh copy of ``cpu_index``."""
        gpu: Any = faiss
        self.index = gpu.index_cpu_to_gpu(self._resources, self.device, cpu_index, self._options)

    def add(self, vectors: np.ndarray, ids: np.ndarray) -> None:
        self.index.add_with_ids(vectors, ids)

    def search(self, queries: np.ndarray, k: int, nprobe: int) -> tuple[np.ndarray, np.ndarray]:
        self.index.nprobe = nprobe
        scores, ids = self.index.search(queries, k)
        return scores, ids
