"""Optional GPU serving: a GPU copy of a shard's IVF-PQ, kept in step with the CPU index.

The CPU index stays the source of truth (snapshots, removes, filtered searches); the GPU
copy serves unfiltered searches with float16 lookup tables. Every change reaches the copy
incrementally: adds are added to it; removes (faiss-gpu's IVF indexes have no
``remove_ids``: ``Index::remove_ids`` throws) leave the old entries in the copy and mark
their ids *stale*. A search on the copy fetches a few more candidates than asked (as many
as the stale share of the copy would displace) and drops the stale entries; an id added
again goes into the copy under an alias, so its old entry is dropped and its new one
answers with the copy's own score; one vectorised pass, outside the copy's lock
(:mod:`.gpu_stale`). Once the stale entries pass
:data:`REBUILD_FRACTION` of the copy, a background thread rebuilds it: the old copy is
freed first (GPU memory never holds two), searches go to the CPU index meanwhile, and
writes wait for the copy (the log is consumed again once it is made; the lag metric shows
it); searches are never blocked by a copy.

What faiss-gpu does not do, and how this module copes (none of it needs a GPU to test;
``tests/support/faiss_gpu_api.json`` holds the faiss-gpu wheel's own API, and the tests
refuse any name or option not in it). The wheel itself refuses nothing: its SWIG proxies
take an unknown attribute as a plain Python attribute that faiss never reads (faiss
1.15.1: ``SearchParametersIVF().useFloat16LookupTables = True`` passes), so a misspelt
option is silently ignored on a GPU node; the name-list test is the only guard:

* it refuses IVF-PQ settings outside its kernels (pq_m 192 of a 768-d default, for one):
  :meth:`GpuMirror.sync` checks them first and raises :class:`GpuUnavailable`, as it does
  when the copy itself fails, for whatever reason; :func:`attach_or_fallback` then keeps
  the shard on its CPU index, logs why and sets ``index_gpu_serving`` to 0 with the
  reason in ``index_gpu_fallback_total``;
* the copy's float16 lookup tables are the cloner's ``useFloat16`` (``GpuCloner.cpp``:
  ``config.useFloat16LookupTables = useFloat16``): pq_m 56, 64 and 96 need them to fit
  the 48 KiB of shared memory per block;
* it selects at most :data:`GPU_MAX_K` results per query and probes at most as many
  lists, and refuses to copy an index whose stored ``nprobe`` is larger
  (``GpuIndexIVF::copyFrom`` → ``validateNProbe``): the copy is made with the stored
  nprobe clamped, and larger fetches or nprobes are served by the CPU index;
* its indexes are not thread-safe, not even for searches (faiss wiki, "Threads and
  asynchronous calls"), while the shard searches from several batcher threads: every
  call on the GPU copy holds one lock;
* ``nprobe`` is passed per call (``SearchParametersIVF``), never set on the shared index;
* any error of the copy, an add or a search turns the copy off: the shard serves from its
  CPU index, ``index_gpu_serving`` goes to 0 and ``index_gpu_fallback_total`` counts the
  reason (``copy_failed``, ``add_failed``, ``search_failed``, ``rebuild_failed``). A copy
  that was serving is then made again in the background, with the writers kept out
  during the copy, after :data:`REATTACH_FIRST_S`, doubling up to :data:`REATTACH_MAX_S`
  between attempts (``index_gpu_reattaches_total``); ``index_gpu_wanted`` is 1 where GPU
  serving was asked for and faiss sees a GPU, so ``GtrIndexGpuFallback`` fires on a
  replica that wants its GPU and serves from its CPU index.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import faiss
import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge

from services.common.errors import FailedPrecondition
from services.index.core.gpu_stale import AliasCollision, StaleIds, drop_stale
from services.index.core.trained import gpu_pq_problem

log = logging.getLogger(__name__)

GPU_MAX_K = 2048  # faiss/gpu GPU_MAX_SELECTION_K: largest k (and nprobe) of a GPU search
# Stale entries (removed or replaced ids) in the copy, as a share of it, that start a
# rebuild. Each costs the searches on the copy an extra candidate per 1/share fetched.
REBUILD_FRACTION = 0.1
# A copy turned off by an error is made again after this long, doubling per failure.
REATTACH_FIRST_S = 1.0
REATTACH_MAX_S = 300.0


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


def cloner_options(lib: Any) -> Any:
    """The options of the copy, from ``lib`` (the faiss module, faiss-gpu on a GPU node).

    ``useFloat16``: float16 lookup tables for an IVF-PQ (needed for pq_m 56, 64, 96);
    64-bit ids, as the CPU index has.
    """
    options = lib.GpuClonerOptions()
    options.useFloat16 = True
    options.indicesOptions = lib.INDICES_64_BIT
    return options


Copier = Callable[[faiss.Index], Any]


@dataclass
class GpuMetrics:
    serving: Gauge
    fallbacks: Counter
    rebuilds: Counter
    labels: tuple[str, str]
    wanted: Gauge | None = None
    reattaches: Counter | None = None

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
                "GPU serving asked for but the shard stayed on (or went back to) its CPU "
                "index, by reason.",
                ["shard", "replica", "reason"],
                registry=registry,
            ),
            rebuilds=Counter(
                "index_gpu_rebuilds",
                "GPU copies rebuilt from the CPU index to drop the entries of removed ids.",
                ["shard", "replica"],
                registry=registry,
            ),
            labels=(str(shard), replica),
            wanted=Gauge(
                "index_gpu_wanted",
                "1 when GPU serving is asked for and faiss sees a GPU (so index_gpu_serving "
                "0 is a fallback).",
                ["shard", "replica"],
                registry=registry,
            ),
            reattaches=Counter(
                "index_gpu_reattaches",
                "GPU copies made again after an error had turned the copy off.",
                ["shard", "replica"],
                registry=registry,
            ),
        )

    def set_serving(self, on: bool) -> None:
        self.serving.labels(*self.labels).set(1 if on else 0)


class GpuMirror:
    """A GPU copy of one IVF-PQ index on ``device``.

    ``copier`` turns the CPU index into the GPU one (default: ``index_cpu_to_gpu`` of
    ``lib`` with :func:`cloner_options`); tests pass their own, or a ``lib`` that holds
    only what faiss-gpu has.
    """

    def __init__(
        self,
        device: int = 0,
        copier: Copier | None = None,
        lib: Any = faiss,
        metrics: GpuMetrics | None = None,
        rebuild_fraction: float = REBUILD_FRACTION,
        reattach_first_s: float = REATTACH_FIRST_S,
    ) -> None:
        self.device = device
        self._lib = lib
        self._copier = copier or self._to_gpu
        self._resources: Any = None
        self._lock = threading.Lock()  # GPU indexes are not thread-safe, not even to search
        self.index: Any = None  # None: off (failed), or being rebuilt
        self._cpu: faiss.Index | None = None
        self.metrics = metrics
        self.rebuild_fraction = rebuild_fraction
        self.cpu_served = 0  # searches sent to the CPU index (over GPU_MAX_K, copy off)
        self.entries = 0  # entries in the copy, stale ones included
        # ids with a removed or outdated entry in the copy, and those added back since
        self.sets = StaleIds.none()
        self.dead = 0  # entries of the copy no search may return
        self.failure: str | None = None  # why the copy is off (until it is made again)
        self.rebuilds = 0
        self.reattaches = 0
        self.reattach_first_s = reattach_first_s
        self._rebuild: threading.Thread | None = None
        self._reattach: threading.Thread | None = None
        self._writes: AbstractContextManager[Any] | None = None  # the shard's writers
        self._closed = threading.Event()

    # --- the copy ----------------------------------------------------------------------

    def _to_gpu(self, cpu_index: faiss.Index) -> Any:
        lib = self._lib
        if self._resources is None:
            self._resources = lib.StandardGpuResources()
        return lib.index_cpu_to_gpu(self._resources, self.device, cpu_index, cloner_options(lib))

    def _copy(self, cpu_index: faiss.Index) -> Any:
        """The GPU copy of ``cpu_index``; GpuUnavailable (with faiss's reason) if it fails.

        The caller keeps writers out meanwhile (searches may run). The stored nprobe is
        clamped to :data:`GPU_MAX_K` during the copy, which refuses more; nprobe comes per
        call anyway.
        """
        problem = gpu_index_problem(cpu_index)
        if problem is not None:
            raise GpuUnavailable(problem)
        ivf = faiss.extract_index_ivf(cpu_index)
        stored = int(ivf.nprobe)
        ivf.nprobe = min(stored, GPU_MAX_K)
        try:
            return self._copier(cpu_index)
        except Exception as exc:  # faiss raises RuntimeError; SWIG AttributeError, ...
            msg = f"faiss could not copy the index to GPU {self.device}: {exc!r}"
            raise GpuUnavailable(msg) from exc
        finally:
            ivf.nprobe = stored

    def sync(
        self, cpu_index: faiss.Index, writes: AbstractContextManager[Any] | None = None
    ) -> None:
        """Replace the GPU copy with a fresh copy of ``cpu_index``; GpuUnavailable if it
        can't. ``writes`` keeps the shard's writers out (held by the caller now; a
        re-attach after an error takes it)."""
        copy = self._copy(cpu_index)
        self._writes = writes if writes is not None else self._writes
        self._install(copy, cpu_index)

    def _install(self, copy: Any, cpu_index: faiss.Index) -> None:
        with self._lock:
            self.index, self._cpu = copy, cpu_index
            self.entries, self.dead = int(cpu_index.ntotal), 0
            self.sets = StaleIds.none()
            self.failure = None

    def _fail(self, reason: str, detail: str) -> None:
        """Turn the copy off: the shard serves from its CPU index until a re-attach."""
        with self._lock:
            self.index, self.failure = None, f"{reason}: {detail}"
        log.warning("GPU copy off, searches go to the CPU index (%s): %s", reason, detail)
        if self.metrics is not None:
            self.metrics.set_serving(False)
            self.metrics.fallbacks.labels(*self.metrics.labels, reason).inc()
        self._start_reattach()

    def _start_reattach(self) -> None:
        if self._writes is None or self._cpu is None or self._closed.is_set():
            return  # never attached: nothing to come back to
        if self._reattach is not None and self._reattach.is_alive():
            return
        self._reattach = threading.Thread(target=self._reattach_loop, name="gpu-reattach")
        self._reattach.daemon = True
        self._reattach.start()

    def _reattach_loop(self) -> None:
        """Copy the CPU index again after a backoff (doubling up to REATTACH_MAX_S) until
        it works or :meth:`close`; writers wait during each copy, searches do not."""
        delay = self.reattach_first_s
        cpu, writes = self._cpu, self._writes
        assert cpu is not None and writes is not None
        while not self._closed.wait(delay):
            try:
                with writes:
                    copy = self._copy(cpu)
                    self._install(copy, cpu)
            except GpuUnavailable as exc:
                log.warning("GPU copy still off, next try in %.0f s: %s", 2 * delay, exc.message)
                delay = min(2 * delay, REATTACH_MAX_S)
                continue
            self.reattaches += 1
            log.info("GPU copy made again: searches served from GPU %d", self.device)
            if self.metrics is not None:
                self.metrics.set_serving(True)
                if self.metrics.reattaches is not None:
                    self.metrics.reattaches.labels(*self.metrics.labels).inc()
            return

    def wait_reattached(self, timeout: float | None = None) -> bool:
        """True once no re-attach is pending (for tests and shutdown)."""
        thread = self._reattach
        if thread is not None:
            thread.join(timeout)
        return thread is None or not thread.is_alive()

    def close(self) -> None:
        """Stop re-attaching (the shard is closing)."""
        self._closed.set()

    # --- changes (under the shard's write lock) ----------------------------------------

    def add(self, vectors: np.ndarray, ids: np.ndarray) -> None:
        with self._lock:
            if self.index is None:  # off, or being rebuilt (the rebuild copies it)
                return
            try:
                sets, as_copy = self.sets.added(ids)  # ids added again: under aliases
            except AliasCollision:  # a 63-bit collision with an alias: copy afresh
                log.warning("an added id equals an alias of the GPU copy: rebuilding it")
                sets, as_copy = self.sets, ids
                self.dead = max(self.dead, self.entries + len(ids))  # needs_rebuild
            try:
                self.index.add_with_ids(vectors, as_copy)
                self.entries += len(ids)
                self.sets = sets
                return
            except Exception as exc:
                error = exc
        self._fail("add_failed", repr(error))

    def remove(self, ids: np.ndarray) -> None:
        """``ids`` left the CPU index: their entries in the copy are stale from now on."""
        with self._lock:
            if self.index is None:
                return
            self.sets = self.sets.removed(ids)
            self.dead += len(ids)

    def needs_rebuild(self) -> bool:
        return (
            self.index is not None
            and self.dead > 0
            and self.dead > self.rebuild_fraction * max(self.entries, 1)
            and (self._rebuild is None or not self._rebuild.is_alive())
        )

    def start_rebuild(self, cpu_index: faiss.Index, writes: AbstractContextManager[Any]) -> None:
        """Rebuild the copy in the background; ``writes`` keeps the shard's writers out."""
        self._rebuild = threading.Thread(
            target=self.rebuild, args=(cpu_index, writes), name="gpu-rebuild", daemon=True
        )
        self._rebuild.start()

    def rebuild(self, cpu_index: faiss.Index, writes: AbstractContextManager[Any]) -> None:
        """Free the copy (searches go to the CPU index), copy ``cpu_index`` again."""
        with self._lock:
            self.index = None  # the only reference: faiss frees its GPU memory now
        try:
            with writes:
                copy = self._copy(cpu_index)
                entries = int(cpu_index.ntotal)
        except GpuUnavailable as exc:
            self._fail("rebuild_failed", exc.message)
            return
        with self._lock:
            self.index, self.entries, self.dead = copy, entries, 0
            self.sets = StaleIds.none()
        self.rebuilds += 1
        if self.metrics is not None:
            self.metrics.rebuilds.labels(*self.metrics.labels).inc()

    def wait_rebuilt(self, timeout: float | None = None) -> bool:
        """True once no rebuild is running (for tests and shutdown)."""
        thread = self._rebuild
        if thread is not None:
            thread.join(timeout)
        return thread is None or not thread.is_alive()

    # --- searches (under the shard's read lock) ----------------------------------------

    def search(self, queries: np.ndarray, k: int, nprobe: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` of the copy; the CPU index answers what the GPU cannot (k or nprobe
        over 2,048, or the copy off or being rebuilt).

        Called under the shard's read lock, so the CPU index does not change meanwhile.
        """
        cpu = self._cpu
        assert cpu is not None
        params = faiss.SearchParametersIVF(nprobe=nprobe)  # type: ignore[call-arg]
        if k <= GPU_MAX_K and nprobe <= GPU_MAX_K:
            error: Exception | None = None
            grid: tuple[np.ndarray, np.ndarray] | None = None
            sets = StaleIds.none()
            with self._lock:
                if self.index is not None:
                    sets = self.sets  # replaced, never changed in place: safe to read later
                    try:
                        grid = self.index.search(queries, self._fetch(k), params=params)
                    except Exception as exc:
                        error = exc
            if grid is not None:  # outside the lock: the next search may use the GPU
                return drop_stale(grid[0], grid[1], k, sets, cpu.metric_type == faiss.METRIC_L2)
            if error is not None:
                self._fail("search_failed", repr(error))
        self.cpu_served += 1
        scores, ids = cpu.search(queries, k, params=params)
        return scores, ids

    def _fetch(self, k: int) -> int:
        """k, and as many more as the stale entries are expected to displace (twice)."""
        if not self.dead:
            return k
        share = self.dead / max(self.entries, 1)
        return min(GPU_MAX_K, k + max(8, math.ceil(2 * k * share)))


class GpuServable(Protocol):
    """What :func:`attach_or_fallback` needs of a shard
    (:class:`~services.index.core.shard.IvfPqShard`, which imports this module)."""

    @property
    def index(self) -> faiss.Index: ...

    def attach_gpu(self, mirror: GpuMirror) -> None: ...


def attach_or_fallback(
    shard: GpuServable,
    wanted: bool,
    device: int,
    metrics: GpuMetrics | None = None,
    mirror: GpuMirror | None = None,
) -> bool:
    """Serve ``shard`` from a GPU copy if ``wanted`` and possible; else stay on the CPU.

    Never raises for a GPU problem: the reason is logged and counted
    (``index_gpu_fallback_total{reason=no_gpu|unsupported_index|copy_failed}``); later
    failures of the copy are counted by the mirror itself.
    """
    reason, detail = "", ""
    if wanted:
        usable, status = gpu_status()
        if not usable:
            reason, detail = "no_gpu", status
        elif (problem := gpu_index_problem(shard.index)) is not None:
            reason, detail = "unsupported_index", problem
        else:
            mirror = mirror or GpuMirror(device)
            mirror.metrics = metrics
            try:
                shard.attach_gpu(mirror)
            except GpuUnavailable as exc:
                reason, detail = "copy_failed", exc.message
    served = wanted and not reason
    if metrics is not None:
        metrics.set_serving(served)
        if metrics.wanted is not None:
            metrics.wanted.labels(*metrics.labels).set(1 if wanted and reason != "no_gpu" else 0)
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
