"""Optional GPU serving: a GPU copy of a shard's IVF-PQ, kept in step with the CPU index.

The CPU index stays the source of truth (snapshots, removes, filtered searches); the GPU
copy serves unfiltered searches with float16 lookup tables. Adds go to both; a batch
that removes anything re-copies the CPU index to the GPU (GPU IVF indexes have no
direct map, so removes there would be a scan).

What faiss-gpu does not do, and how this module copes (none of it needs a GPU to test):

* it refuses IVF-PQ settings outside its kernels (pq_m 192 of a 768-d default, for one):
  :meth:`GpuMirror.sync` checks them first and raises :class:`GpuUnavailable`, as it does
  when the copy itself fails; :func:`attach_or_fallback` then keeps the shard on its CPU
  index, logs why and sets ``index_gpu_serving`` to 0 with the reason in
  ``index_gpu_fallback_total``;
* it selects at most :data:`GPU_MAX_K` results per query (and probes at most as many
  lists): larger fetches (k × refine factor goes up to 4,000) are served by the CPU index;
* its indexes are not thread-safe, not even for searches (faiss wiki, "Threads and
  asynchronous calls"), while the shard searches from several batcher threads: every
  call on the GPU copy holds one lock;
* ``nprobe`` is passed per call (``SearchParametersIVF``), never set on the shared index.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import faiss
import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge

from services.common.errors import FailedPrecondition
from services.index.core.train import gpu_pq_problem

if TYPE_CHECKING:
    from services.index.core.shard import IvfPqShard

log = logging.getLogger(__name__)

GPU_MAX_K = 2048  # faiss/gpu GPU_MAX_SELECTION_K: largest k (and nprobe) of a GPU search


class GpuUnavailable(FailedPrecondition):
    """The index cannot be served from a GPU (with the reason)."""


def gpu_status() -> tuple[bool, str]:
    """(usable, reason): whether searches can be served from a GPU, and why (not)."""
    if not hasattr(faiss, "StandardGpuResources"):
        return False, "this faiss build has no GPU support (faiss-cpu)"
    count = int(faiss.get_num_gpus())
    if count == 0:
        return False, "faiss sees no GPU device"
    return True, f"{count} GPU(s) visible to faiss"


def gpu_index_problem(cpu_index: faiss.Index) -> str | None:
    """Why faiss-gpu would refuse to copy ``cpu_index`` (an IVF-PQ), or None."""
    ivf: Any = faiss.downcast_index(faiss.extract_index_ivf(cpu_index))
    pq = getattr(ivf, "pq", None)
    if pq is None:
        return None
    return gpu_pq_problem(int(ivf.d), int(pq.M), int(pq.nbits))


Copier = Callable[[faiss.Index], Any]


class GpuMirror:
    """A GPU copy of one IVF-PQ index on ``device``.

    ``copier`` turns the CPU index into the GPU one (default: ``index_cpu_to_gpu`` with
    float16 lookup tables and 64-bit ids); tests pass their own.
    """

    def __init__(self, device: int = 0, copier: Copier | None = None) -> None:
        self.device = device
        self._copier = copier or self._to_gpu
        self._resources: Any = None
        self._lock = threading.Lock()  # GPU indexes are not thread-safe, not even to search
        self.index: Any = None
        self._cpu: faiss.Index | None = None
        self.cpu_served = 0  # searches sent to the CPU index (k or nprobe over GPU_MAX_K)

    def _to_gpu(self, cpu_index: faiss.Index) -> Any:
        gpu: Any = faiss
        if self._resources is None:
            self._resources = gpu.StandardGpuResources()
        options = gpu.GpuClonerOptions()
        options.useFloat16LookupTables = True  # needed for pq_m 56, 64, 96
        options.indicesOptions = gpu.INDICES_64_BIT
        return gpu.index_cpu_to_gpu(self._resources, self.device, cpu_index, options)

    def sync(self, cpu_index: faiss.Index) -> None:
        """Replace the GPU copy with a fresh copy of ``cpu_index``; GpuUnavailable if it can't."""
        problem = gpu_index_problem(cpu_index)
        if problem is not None:
            raise GpuUnavailable(problem)
        try:
            copy = self._copier(cpu_index)
        except (RuntimeError, MemoryError) as exc:  # faiss raises RuntimeError
            msg = f"faiss could not copy the index to GPU {self.device}: {exc}"
            raise GpuUnavailable(msg) from exc
        with self._lock:
            self.index, self._cpu = copy, cpu_index

    def add(self, vectors: np.ndarray, ids: np.ndarray) -> None:
        with self._lock:
            self.index.add_with_ids(vectors, ids)

    def search(self, queries: np.ndarray, k: int, nprobe: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` of the copy; the CPU index answers what the GPU cannot (k > 2,048).

        Called under the shard's read lock, so the CPU index does not change meanwhile.
        """
        params = faiss.SearchParametersIVF(nprobe=nprobe)  # type: ignore[call-arg]
        if k > GPU_MAX_K or nprobe > GPU_MAX_K:
            assert self._cpu is not None
            self.cpu_served += 1
            scores, ids = self._cpu.search(queries, k, params=params)
            return scores, ids
        with self._lock:
            scores, ids = self.index.search(queries, k, params=params)
        return scores, ids


@dataclass
class GpuMetrics:
    serving: Gauge
    fallbacks: Counter
    labels: tuple[str, str]

    @classmethod
    def create(cls, registry: CollectorRegistry, shard: int, replica: str) -> GpuMetrics:
        return cls(
            serving=Gauge(
                "index_gpu_serving",
                "1 when unfiltered searches are served from a GPU copy of the index.",
                ["shard", "replica"],
                registry=registry,
            ),
            fallbacks=Counter(
                "index_gpu_fallback",
                "GPU serving asked for but the shard stayed on its CPU index, by reason.",
                ["shard", "replica", "reason"],
                registry=registry,
            ),
            labels=(str(shard), replica),
        )


def attach_or_fallback(
    shard: IvfPqShard,
    wanted: bool,
    device: int,
    metrics: GpuMetrics | None = None,
    mirror: GpuMirror | None = None,
) -> bool:
    """Serve ``shard`` from a GPU copy if ``wanted`` and possible; else stay on the CPU.

    Never raises for a GPU problem: the reason is logged and counted
    (``index_gpu_fallback_total{reason=no_gpu|unsupported_index|copy_failed}``).
    """
    reason, detail = "", ""
    if wanted:
        usable, status = gpu_status()
        if not usable:
            reason, detail = "no_gpu", status
        elif (problem := gpu_index_problem(shard.index)) is not None:
            reason, detail = "unsupported_index", problem
        else:
            try:
                shard.attach_gpu(mirror or GpuMirror(device))
            except GpuUnavailable as exc:
                reason, detail = "copy_failed", exc.message
    served = wanted and not reason
    if metrics is not None:
        metrics.serving.labels(*metrics.labels).set(1 if served else 0)
        if reason:
            metrics.fallbacks.labels(*metrics.labels, reason).inc()
    if served:
        log.info("searches served from GPU %d", device)
    elif reason == "no_gpu":  # the usual case on CPU machines: not worth a warning
        log.info("GPU path skipped: %s", detail)
    elif wanted:
        log.warning("GPU serving asked for, searches stay on the CPU index: %s", detail)
    else:
        log.info("GPU path skipped: disabled by settings")
    return served
