"""The GPU path: what faiss-gpu refuses is checked here; the real copy where faiss sees a GPU.

Without a GPU, :class:`GpuMirror` is exercised with a fake GPU index that behaves like
faiss-gpu in what matters: it refuses k and nprobe above 2,048 (and an index whose stored
nprobe is larger), has no ``remove_ids``, fails when two threads are inside it at once,
and fails if anyone sets ``nprobe`` on it. The copy itself goes through
:class:`StrictFaissGpu`: the faiss-gpu wheel's own names and class attributes
(``tests/support/faiss_gpu_api.json``, extracted by ``scripts/faiss_gpu_api.py`` from its
``swigfaiss.py``), refusing anything else. The real wheel would not refuse it: its SWIG
proxies accept an unknown attribute silently, so these name checks are the only guard.
"""

from __future__ import annotations

import threading
import weakref
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from services.index.core.changes import Delete, Upsert
from services.index.core.gpu import (
    GpuMetrics,
    GpuMirror,
    GpuUnavailable,
    attach_or_fallback,
    cloner_options,
    gpu_status,
)
from services.index.core.shard import IvfPqShard
from services.index.core.train import TrainOptions, train_index
from services.index.core.trained import TrainedIndex
from tests.support.faiss_gpu import FAISS_GPU_API, FakeGpuIndex, StrictFaissGpu, unit
from tests.support.processes import wait_until


@pytest.fixture(scope="module")
def trained_64(tmp_path_factory: pytest.TempPathFactory) -> TrainedIndex:
    out = tmp_path_factory.mktemp("gpu64")
    train_index(unit(3000, 64), out, TrainOptions(nlist=16, pq_m=16))
    return TrainedIndex.load(out)


@pytest.fixture(scope="module")
def trained_768(tmp_path_factory: pytest.TempPathFactory) -> TrainedIndex:
    """768-d with the default pq_m (dim/4 = 192): what GTR shards get without --gpu."""
    out = tmp_path_factory.mktemp("gpu768")
    train_index(unit(300, 768), out, TrainOptions(nlist=2))
    return TrainedIndex.load(out)


def _fake_shard(
    trained: TrainedIndex, n: int = 2000, **mirror: Any
) -> tuple[IvfPqShard, list[FakeGpuIndex]]:
    fakes: list[FakeGpuIndex] = []

    def copier(cpu_index: faiss.Index) -> FakeGpuIndex:
        fakes.append(FakeGpuIndex(cpu_index))
        return fakes[-1]

    shard = IvfPqShard(trained)
    shard.attach_gpu(GpuMirror(copier=copier, **mirror))
    x = unit(n, 64, seed=1)
    shard.apply([Upsert(str(i), x[i]) for i in range(n)], "1-0")
    return shard, fakes


def test_gpu_status_always_gives_a_reason() -> None:
    usable, reason = gpu_status()
    assert isinstance(usable, bool) and reason


@pytest.mark.slow
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
    x = unit(3, 768, seed=3)
    shard.apply([Upsert("a", x[0])], "1-0")
    assert shard.search(x[:1], 1)[0][0][0] == "a"


@pytest.mark.slow
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
    q = unit(2, 64, seed=2)
    small = shard.search_top_k(q, 10, nprobe=4)  # fetch 40: the GPU
    assert fakes[-1].calls == [(40, 4)]
    big = shard.search_top_k(q, 1000, nprobe=4)  # fetch 4,000 > 2,048: the CPU index
    assert fakes[-1].calls == [(40, 4)] and shard.gpu.cpu_served == 1
    assert big.hits()[0][:10] == small.hits()[0]


def test_gpu_searches_are_serialised_and_nprobe_is_per_call(trained_64: TrainedIndex) -> None:
    shard, fakes = _fake_shard(trained_64)
    q = unit(8, 64, seed=4)
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


def test_the_copy_sets_only_options_faiss_gpu_has(trained_64: TrainedIndex) -> None:
    """Issue #25 item 1: float16 lookup tables are the cloner's ``useFloat16``
    (``useFloat16LookupTables`` is a GpuIndexIVFPQConfig field the cloner options lack)."""
    lib = StrictFaissGpu()
    mirror = GpuMirror(device=1, lib=lib)
    mirror.sync(trained_64.index)  # AttributeError here for an option faiss-gpu lacks
    [(device, options)] = lib.copies
    assert device == 1
    assert options.values == {"useFloat16": True, "indicesOptions": "INDICES_64_BIT"}
    assert cloner_options(lib).values == options.values


def test_the_api_extract_is_faiss_gpus() -> None:
    """The extract the strict module reads is the real one, with the trap of item 1 in it."""
    assert FAISS_GPU_API["faiss_gpu_version"] == faiss.__version__
    assert "useFloat16LookupTables" in FAISS_GPU_API["classes"]["GpuIndexIVFPQConfig"]
    assert "useFloat16LookupTables" not in FAISS_GPU_API["classes"]["GpuClonerOptions"]
    with pytest.raises(AttributeError):
        StrictFaissGpu().GpuClonerOptions().useFloat16LookupTables = True


def test_every_faiss_name_of_the_gpu_path_exists_in_faiss() -> None:
    """Item 1: every ``faiss.X`` and ``lib.X`` that services/index/core/gpu.py uses is a
    name of faiss-cpu (here) or of faiss-gpu (its wheel's API): nothing is taken from
    intent."""
    import ast

    import services.index.core.gpu as gpu_module

    tree = ast.parse(Path(gpu_module.__file__).read_text())
    used = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in {"faiss", "lib"}
    }
    assert {"GpuClonerOptions", "index_cpu_to_gpu", "StandardGpuResources"} <= used
    unknown = {n for n in used if not hasattr(faiss, n) and n not in FAISS_GPU_API["module"]}
    assert not unknown, unknown


def test_any_error_of_the_copy_falls_back_with_its_reason(
    trained_64: TrainedIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 1: an AttributeError (or any other) of the copy keeps the shard on the CPU."""
    import services.index.core.gpu as gpu_module

    def copier(cpu_index: faiss.Index) -> Any:
        raise AttributeError("'GpuClonerOptions' object has no attribute 'x'")

    monkeypatch.setattr(gpu_module, "gpu_status", lambda: (True, "pretend"))
    registry = CollectorRegistry()
    shard = IvfPqShard(trained_64)
    metrics = GpuMetrics.create(registry, 0, "r0")
    assert not attach_or_fallback(shard, True, 0, metrics, GpuMirror(copier=copier))
    reason = {"shard": "0", "replica": "r0", "reason": "copy_failed"}
    assert registry.get_sample_value("index_gpu_fallback_total", reason) == 1
    assert shard.gpu is None


def test_a_stored_nprobe_over_2048_is_clamped_for_the_copy(trained_64: TrainedIndex) -> None:
    """Item 2: the recall-tuned nprobe can reach nlist; faiss-gpu refuses to copy more
    than 2,048. The copy is made at 2,048, the CPU index keeps its own, and a search at
    such an nprobe is answered by the CPU index."""
    index = faiss.clone_index(trained_64.index)
    ivf = faiss.extract_index_ivf(index)
    ivf.nprobe = 3000
    trained = TrainedIndex(trained_64.manifest, index, trained_64.refine)
    shard, fakes = _fake_shard(trained, n=500)
    assert shard.gpu is not None and shard.gpu.index is fakes[-1]
    assert int(faiss.extract_index_ivf(shard.index).nprobe) == 3000
    q = unit(2, 64, seed=2)
    shard.gpu.search(q, 5, 3000)
    assert shard.gpu.cpu_served == 1 and fakes[-1].calls == []


def _hits(shard: IvfPqShard, q: np.ndarray, k: int) -> list[list[str]]:
    return [[d for d, _ in row] for row in shard.search(q, k, nprobe=16)]


def test_updates_reach_the_copy_incrementally(trained_64: TrainedIndex) -> None:
    """Item 3: upserts of existing ids and deletes do not re-copy the shard (faiss-gpu has
    no remove_ids): the copy's stale entries are dropped or re-scored at search, one hit
    per id, and the answers are the CPU index's."""
    shard, fakes = _fake_shard(trained_64, rebuild_fraction=1.0)  # no rebuild here
    cpu = IvfPqShard(trained_64)
    x = unit(2000, 64, seed=1)
    y = unit(300, 64, seed=7)
    batches: list[list[Upsert | Delete]] = [
        [Upsert(str(i), x[i]) for i in range(2000)],
        [Upsert(str(i), y[i]) for i in range(300)]  # moved: old entries stay in the copy
        + [Delete(str(i)) for i in range(300, 500)],
    ]
    for n, batch in enumerate(batches):
        if n:
            shard.apply(batch, f"{n + 1}-0")
        cpu.apply(batch, f"{n + 1}-0")
    assert len(fakes) == 1  # never copied again
    assert shard.gpu is not None and shard.gpu.dead == 500 and len(shard.gpu.sets.stale) == 500
    q = np.concatenate([y[:20], x[300:320], x[1000:1020]])
    got, want = _hits(shard, q, 10), _hits(cpu, q, 10)
    assert fakes[-1].calls and all(k > 40 for k, _ in fakes[-1].calls)  # over-fetched
    assert all(len(set(row)) == len(row) == 10 for row in got)  # one hit per id
    assert not {str(i) for i in range(300, 500)} & {d for row in got for d in row}
    assert [row[0] for row in got[:20]] == [str(i) for i in range(20)]  # the new vectors
    overlap = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(got, want, strict=True)])
    assert overlap >= 0.95, overlap


def test_a_failing_copy_never_stops_apply(
    trained_64: TrainedIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 3: a GPU error in an update turns the copy off (reason in the metric); the
    batch is applied and searches go on from the CPU index."""
    import services.index.core.gpu as gpu_module

    class FailingAdd(FakeGpuIndex):
        def add_with_ids(self, x: np.ndarray, ids: np.ndarray) -> None:
            raise RuntimeError("cudaMalloc error out of memory")

    monkeypatch.setattr(gpu_module, "gpu_status", lambda: (True, "pretend"))
    registry = CollectorRegistry()
    shard = IvfPqShard(trained_64)
    mirror = GpuMirror(copier=FailingAdd)
    assert attach_or_fallback(shard, True, 0, GpuMetrics.create(registry, 3, "r3"), mirror)
    x = unit(50, 64, seed=1)
    result = shard.apply([Upsert(str(i), x[i]) for i in range(50)], "1-0")
    assert result.added == 50 and shard.applied == "1-0"
    labels = {"shard": "3", "replica": "r3"}
    assert registry.get_sample_value("index_gpu_serving", labels) == 0
    reason = {**labels, "reason": "add_failed"}
    assert registry.get_sample_value("index_gpu_fallback_total", reason) == 1
    assert mirror.index is None and "out of memory" in (mirror.failure or "")
    assert shard.search(x[:1], 1)[0][0][0] == "0"
    assert mirror.cpu_served == 1


def test_a_rebuild_frees_the_old_copy_first_and_never_blocks_searches(
    trained_64: TrainedIndex,
) -> None:
    """Item 3: past the stale share a background thread re-copies the shard: the old copy
    is freed before the new one is made (GPU memory never holds two), searches are served
    by the CPU index meanwhile, and writes wait for the copy."""
    release = threading.Event()
    copying = threading.Event()
    copies: list[weakref.ref[FakeGpuIndex]] = []
    old_alive: list[bool] = []

    def copier(cpu_index: faiss.Index) -> FakeGpuIndex:
        if copies:  # the rebuild
            old_alive.append(copies[0]() is not None)
            copying.set()
            assert release.wait(30)
        fake = FakeGpuIndex(cpu_index)
        copies.append(weakref.ref(fake))
        return fake

    shard = IvfPqShard(trained_64)
    registry = CollectorRegistry()
    metrics = GpuMetrics.create(registry, 0, "r0")
    mirror = GpuMirror(copier=copier, metrics=metrics, rebuild_fraction=0.1)
    shard.attach_gpu(mirror)
    x = unit(1000, 64, seed=1)
    shard.apply([Upsert(str(i), x[i]) for i in range(1000)], "1-0")
    shard.apply([Delete(str(i)) for i in range(200)], "2-0")  # 20 % stale: rebuild
    assert copying.wait(30)
    later = threading.Thread(target=shard.apply, args=([Upsert("new", x[0])], "3-0"))
    later.start()  # waits for the copy
    wait_until(lambda: shard._writes.locked() and later.is_alive(), "the write waits")
    assert _hits(shard, x[500:501], 1) == [["500"]]  # not blocked: the CPU index answers
    assert mirror.cpu_served >= 1 and shard.applied == "2-0"
    release.set()
    assert mirror.wait_rebuilt(30)
    later.join(30)
    assert shard.applied == "3-0"
    assert old_alive == [False]  # freed before the new copy was made
    assert len(copies) == 2 and mirror.index is copies[-1]()
    assert mirror.dead == 0 and len(mirror.sets.stale) == 0 and mirror.entries == 801
    assert (
        registry.get_sample_value("index_gpu_rebuilds_total", {"shard": "0", "replica": "r0"}) == 1
    )
    assert _hits(shard, x[500:501], 1) == [["500"]]
    assert copies[-1]().calls  # type: ignore[union-attr]  # answered by the new copy


@pytest.mark.gpu
def test_gpu_copy_answers_like_the_cpu_index(tmp_path: Path) -> None:
    """Issue #25 items 1-3 on a real GPU: pq_m 64 (float16 lookup tables only), a stored
    nprobe over 2,048, upserts and deletes reaching the copy, a rebuild."""
    usable, reason = gpu_status()
    if not usable:
        pytest.skip(
            "issue #25 items 1-3 (the faiss-gpu copy with float16 tables, a stored nprobe "
            f"over 2,048, incremental updates and rebuilds) need a GPU: {reason}"
        )
    x = unit(4000, 128)
    train_index(x, tmp_path, TrainOptions(nlist=32, pq_m=64))
    trained = TrainedIndex.load(tmp_path)
    faiss.extract_index_ivf(trained.index).nprobe = 3000  # what tuning reaches on big nlist
    cpu, gpu = IvfPqShard(trained), IvfPqShard(trained)
    gpu.attach_gpu(GpuMirror())
    mirror = gpu.gpu
    assert mirror is not None
    batches: list[list[Upsert | Delete]] = [
        [Upsert(str(i), x[i]) for i in range(3000)],
        [Upsert(str(i), x[3999 - i]) for i in range(100)],  # moved: stale in the copy
        [Delete(str(i)) for i in range(100, 200)],
    ]
    for n, batch in enumerate(batches):
        for shard in (cpu, gpu):
            shard.apply(batch, f"{n + 1}-0")
    assert mirror.rebuilds == 0 and mirror.dead == 200 and mirror.failure is None

    def overlap() -> float:
        a, b = cpu.search(x[:50], 10, 8), gpu.search(x[:50], 10, 8)
        pairs = zip(a, b, strict=True)
        return float(np.mean([len({d for d, _ in p} & {d for d, _ in q}) / 10 for p, q in pairs]))

    assert overlap() >= 0.95
    for shard in (cpu, gpu):
        shard.apply([Delete(str(i)) for i in range(200, 600)], "4-0")  # 20 % stale
    assert mirror.wait_rebuilt(120) and mirror.rebuilds == 1 and mirror.failure is None
    assert mirror.dead == 0 and overlap() >= 0.95
    big = gpu.search(x[:2], 600, 8)  # k 600 x refine 4 > 2,048: served by the CPU index
    assert len(big[0]) == 600
