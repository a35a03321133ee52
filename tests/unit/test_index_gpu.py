"""The GPU path: what faiss-gpu refuses is checked here; the real copy where faiss sees a GPU.

Without a GPU, :class:`GpuMirror` is exercised with a fake GPU index (``copier``) that
behaves like faiss-gpu in what matters: it refuses k above 2,048, fails when two threads
are inside it at once, and fails if anyone sets ``nprobe`` on it.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from services.index.core.changes import Upsert
from services.index.core.gpu import (
    GPU_MAX_K,
    GpuMetrics,
    GpuMirror,
    GpuUnavailable,
    attach_or_fallback,
    gpu_status,
)
from services.index.core.shard import IvfPqShard
from services.index.core.train import TrainedIndex, TrainOptions, train_index


def _unit(n: int, dim: int, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


class FakeGpuIndex:
    """Answers from a CPU copy; asserts the constraints faiss-gpu has."""

    def __init__(self, cpu_index: faiss.Index) -> None:
        self._index = faiss.clone_index(cpu_index)
        self._inside = 0
        self.calls: list[tuple[int, int]] = []
        self.overlaps = 0

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "nprobe":
            raise AssertionError("nprobe set on a shared GPU index (a race between searches)")
        super().__setattr__(name, value)

    def search(self, x: np.ndarray, k: int, params: Any = None) -> tuple[np.ndarray, np.ndarray]:
        assert k <= GPU_MAX_K, f"faiss-gpu refuses k={k}"
        assert isinstance(params, faiss.SearchParametersIVF), "nprobe must come per call"
        self._inside += 1
        if self._inside > 1:
            self.overlaps += 1
        time.sleep(0.002)
        try:
            self.calls.append((k, int(params.nprobe)))
            scores, ids = self._index.search(x, k, params=params)
            return scores, ids
        finally:
            self._inside -= 1

    def add_with_ids(self, x: np.ndarray, ids: np.ndarray) -> None:
        self._index.add_with_ids(x, ids)


@pytest.fixture(scope="module")
def trained_64(tmp_path_factory: pytest.TempPathFactory) -> TrainedIndex:
    out = tmp_path_factory.mktemp("gpu64")
    train_index(_unit(3000, 64), out, TrainOptions(nlist=16, pq_m=16))
    return TrainedIndex.load(out)


@pytest.fixture(scope="module")
def trained_768(tmp_path_factory: pytest.TempPathFactory) -> TrainedIndex:
    """768-d with the default pq_m (dim/4 = 192): what GTR shards get without --gpu."""
    out = tmp_path_factory.mktemp("gpu768")
    train_index(_unit(300, 768), out, TrainOptions(nlist=2))
    return TrainedIndex.load(out)


def _fake_shard(trained: TrainedIndex, n: int = 2000) -> tuple[IvfPqShard, list[FakeGpuIndex]]:
    fakes: list[FakeGpuIndex] = []

    def copier(cpu_index: faiss.Index) -> FakeGpuIndex:
        fakes.append(FakeGpuIndex(cpu_index))
        return fakes[-1]

    shard = IvfPqShard(trained)
    shard.attach_gpu(GpuMirror(copier=copier))
    x = _unit(n, 64, seed=1)
    shard.apply([Upsert(str(i), x[i]) for i in range(n)], "1-0")
    return shard, fakes


def test_gpu_status_always_gives_a_reason() -> None:
    usable, reason = gpu_status()
    assert isinstance(usable, bool) and reason


def test_768d_default_pq_m_is_refused_before_any_gpu_call(trained_768: TrainedIndex) -> None:
    trained = trained_768
    assert trained.manifest.pq_m == 192 and trained.manifest.gpu_problem

    def copier(cpu_index: faiss.Index) -> Any:
        raise AssertionError("the copy must not be attempted")

    with pytest.raises(GpuUnavailable, match="not 192"):
        GpuMirror(copier=copier).sync(trained.index)


def test_shard_falls_back_to_cpu_with_a_reason_and_a_metric(
    trained_768: TrainedIndex, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import services.index.core.gpu as gpu_module

    shard = IvfPqShard(trained_768)
    registry = CollectorRegistry()
    metrics = GpuMetrics.create(registry, 0, "r0")
    monkeypatch.setattr(gpu_module, "gpu_status", lambda: (True, "1 GPU(s) visible to faiss"))
    with caplog.at_level("WARNING", logger="services.index.core.gpu"):
        served = attach_or_fallback(shard, True, 0, metrics)
    assert not served and shard.gpu is None  # the shard serves, from its CPU index
    assert "not 192" in caplog.text
    labels = {"shard": "0", "replica": "r0"}
    assert registry.get_sample_value("index_gpu_serving", labels) == 0
    reason = {**labels, "reason": "unsupported_index"}
    assert registry.get_sample_value("index_gpu_fallback_total", reason) == 1
    x = _unit(3, 768, seed=3)
    shard.apply([Upsert("a", x[0])], "1-0")
    assert shard.search(x[:1], 1)[0][0][0] == "a"


def test_no_gpu_is_counted_without_a_warning(
    trained_64: TrainedIndex, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import services.index.core.gpu as gpu_module

    monkeypatch.setattr(gpu_module, "gpu_status", lambda: (False, "faiss sees no GPU device"))
    registry = CollectorRegistry()
    shard = IvfPqShard(trained_64)
    with caplog.at_level("INFO", logger="services.index.core.gpu"):
        assert not attach_or_fallback(shard, True, 0, GpuMetrics.create(registry, 2, "r2"))
    assert "GPU path skipped: faiss sees no GPU device" in caplog.text
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    reason = {"shard": "2", "replica": "r2", "reason": "no_gpu"}
    assert registry.get_sample_value("index_gpu_fallback_total", reason) == 1


def test_failed_copy_falls_back_too(
    trained_64: TrainedIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    import services.index.core.gpu as gpu_module

    def copier(cpu_index: faiss.Index) -> Any:
        raise RuntimeError("cudaMalloc error out of memory")

    shard = IvfPqShard(trained_64)
    registry = CollectorRegistry()
    metrics = GpuMetrics.create(registry, 1, "r1")
    monkeypatch.setattr(gpu_module, "gpu_status", lambda: (True, "pretend"))
    assert not attach_or_fallback(shard, True, 0, metrics, GpuMirror(copier=copier))
    reason = {"shard": "1", "replica": "r1", "reason": "copy_failed"}
    assert registry.get_sample_value("index_gpu_fallback_total", reason) == 1
    assert shard.gpu is None


def test_large_fetches_are_served_by_the_cpu_index(trained_64: TrainedIndex) -> None:
    shard, fakes = _fake_shard(trained_64)
    assert shard.gpu is not None
    q = _unit(2, 64, seed=2)
    small = shard.search_top_k(q, 10, nprobe=4)  # fetch 40: the GPU
    assert fakes[-1].calls == [(40, 4)]
    big = shard.search_top_k(q, 1000, nprobe=4)  # fetch 4,000 > 2,048: the CPU index
    assert fakes[-1].calls == [(40, 4)] and shard.gpu.cpu_served == 1
    assert big.hits()[0][:10] == small.hits()[0]


def test_gpu_searches_are_serialised_and_nprobe_is_per_call(trained_64: TrainedIndex) -> None:
    shard, fakes = _fake_shard(trained_64)
    q = _unit(8, 64, seed=4)
    errors: list[BaseException] = []

    def worker(nprobe: int) -> None:
        try:
            for _ in range(20):
                shard.search_top_k(q, 5, nprobe=nprobe)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(p,)) for p in (2, 8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert fakes[-1].overlaps == 0  # never two searches inside the GPU index at once
    assert {p for _, p in fakes[-1].calls} == {2, 8} and len(fakes[-1].calls) == 40


@pytest.mark.gpu
def test_gpu_copy_answers_like_the_cpu_index(tmp_path: Path) -> None:
    usable, reason = gpu_status()
    if not usable:
        pytest.skip(f"GPU path not available: {reason}")
    x = _unit(4000, 64)
    train_index(x, tmp_path, TrainOptions(nlist=32, pq_m=16))
    trained = TrainedIndex.load(tmp_path)
    cpu, gpu = IvfPqShard(trained), IvfPqShard(trained)
    gpu.attach_gpu(GpuMirror())
    for shard in (cpu, gpu):
        shard.apply([Upsert(str(i), x[i]) for i in range(3000)], "1-0")
        shard.apply([Upsert(str(i), x[i]) for i in range(100)], "2-0")  # removes: re-copy
    a, b = cpu.search(x[:50], 10, 8), gpu.search(x[:50], 10, 8)
    overlap = np.mean(
        [len({d for d, _ in p} & {d for d, _ in q}) / 10 for p, q in zip(a, b, strict=True)]
    )
    assert overlap >= 0.95
    big = gpu.search(x[:2], 600, 8)  # k 600 x refine 4 > 2,048: served by the CPU index
    assert len(big[0]) == 600
