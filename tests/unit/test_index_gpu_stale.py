"""Issue #37 item 3: the GPU copy's stale entries dropped in one vectorised pass outside
the copy's lock, ids added again living in the copy under aliases
(services/index/core/gpu_stale.py), and a copy turned off by an error made
again with a backoff, its state exported (``index_gpu_wanted``, ``index_gpu_serving``,
``index_gpu_reattaches_total``; the alert ``GtrIndexGpuFallback`` is tested with promtool
in deploy/prometheus/rules_test.yml). No GPU: the faiss-gpu API mirror of
tests/support/faiss_gpu.py stands in for the copy, as in test_index_gpu.py.
"""

from __future__ import annotations

from typing import Any

import faiss
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

import services.index.core.gpu as gpu_module
from services.index.core.changes import Upsert
from services.index.core.gpu import GpuMetrics, GpuMirror, attach_or_fallback
from services.index.core.gpu_stale import AliasCollision, StaleIds
from services.index.core.shard import IvfPqShard
from services.index.core.train import TrainOptions, train_index
from services.index.core.trained import TrainedIndex
from tests.support.faiss_gpu import FakeGpuIndex, StrictFaissGpu, unit
from tests.support.processes import wait_until


@pytest.mark.parametrize("metric", [faiss.METRIC_INNER_PRODUCT, faiss.METRIC_L2])
def test_the_copy_with_stale_entries_answers_as_the_cpu_index(metric: int) -> None:
    """Deletes and re-adds reach a copy made before them (the mirror's add and remove,
    as the shard's apply calls them); every answer is the CPU index's own: its ids, one
    per id, none removed, each with the score the CPU index gives it, in order."""
    x = unit(3000, 32, seed=1)
    cpu = faiss.index_factory(32, "IVF8,PQ8x8", metric)
    faiss.downcast_index(faiss.extract_index_ivf(cpu)).do_polysemous_training = False  # type: ignore[attr-defined]
    cpu.train(x)
    faiss.extract_index_ivf(cpu).set_direct_map_type(faiss.DirectMap.Hashtable)  # type: ignore[attr-defined]
    cpu.add_with_ids(x, np.arange(3000, dtype=np.int64) * 7919)  # ids far apart, as hashes
    mirror = GpuMirror(copier=faiss.clone_index, rebuild_fraction=1.0)
    mirror.sync(cpu)
    rng = np.random.default_rng(3)
    gone = np.sort(rng.choice(3000, 150, replace=False).astype(np.int64) * 7919)
    back, y = gone[:75], unit(75, 32, seed=9)  # added again with new vectors
    for step in range(2):  # twice: the second re-add turns the first alias stale
        removed = gone if step == 0 else back
        cpu.remove_ids(faiss.IDSelectorArray(removed.size, faiss.swig_ptr(removed)))
        mirror.remove(removed)
        cpu.add_with_ids(y, back)
        mirror.add(y, back)
    assert mirror.sets.alias.size == 75 and set(mirror.sets.alias_of.tolist()) == set(back)
    queries = np.concatenate([y[:8], unit(8, 32, seed=4)])
    scores, ids = mirror.search(queries, 20, 8)
    want_scores, want_ids = cpu.search(queries, 20, params=faiss.SearchParametersIVF(nprobe=8))  # type: ignore[call-arg]
    for row in range(len(queries)):
        got = ids[row][ids[row] >= 0]
        assert len(set(got.tolist())) == len(got)  # one hit per id
        assert not set(got.tolist()) & set(gone[75:].tolist())  # removed ids are gone
        overlap = len(set(got.tolist()) & set(want_ids[row].tolist())) / 20
        assert overlap >= 0.95, (row, overlap)
        same = {
            i: s for i, s in zip(want_ids[row].tolist(), want_scores[row].tolist(), strict=True)
        }
        for fid, score in zip(got.tolist(), scores[row].tolist(), strict=True):
            if fid in same:
                assert abs(same[fid] - score) < 1e-4
        order = scores[row][: len(got)]
        assert (
            (np.diff(order) >= 0).all()
            if metric == faiss.METRIC_L2
            else (np.diff(order) <= 0).all()
        )
    assert set(ids[:8, 0].tolist()) <= set(back.tolist())  # the moved ones, by their new vectors


def test_the_stale_mask_is_exact() -> None:
    rng = np.random.default_rng(5)
    stale = np.unique(rng.integers(0, 2**62, 5000))
    sets = StaleIds(stale)
    grid = np.concatenate([stale[:100], rng.integers(0, 2**62, 10_000), [-1]]).reshape(3, -1)
    assert (sets.mask(grid) == np.isin(grid, stale)).all()


def test_an_added_id_equal_to_a_live_alias_is_refused() -> None:
    sets, as_copy = StaleIds.none().removed(np.array([5])).added(np.array([5, 6]))
    assert as_copy[1] == 6 and as_copy[0] != 5 and sets.real(as_copy).tolist() == [5, 6]
    with pytest.raises(AliasCollision):
        sets.added(as_copy[:1])


def _trained(tmp_path_factory: pytest.TempPathFactory) -> TrainedIndex:
    out = tmp_path_factory.mktemp("stale64")
    train_index(unit(3000, 64), out, TrainOptions(nlist=16, pq_m=16))
    return TrainedIndex.load(out)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> TrainedIndex:
    return _trained(tmp_path_factory)


def test_the_stale_pass_runs_outside_the_copys_lock(
    trained: TrainedIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    shard = IvfPqShard(trained)
    mirror = GpuMirror(copier=FakeGpuIndex, rebuild_fraction=1.0)
    shard.attach_gpu(mirror)
    x = unit(500, 64, seed=1)
    shard.apply([Upsert(str(i), x[i]) for i in range(500)], "1-0")
    y = unit(50, 64, seed=2)
    shard.apply([Upsert(str(i), y[i]) for i in range(50)], "2-0")  # 10 % stale
    held: list[bool] = []
    real = gpu_module.drop_stale

    def spy(*args: Any) -> Any:
        held.append(mirror._lock.locked())
        return real(*args)

    monkeypatch.setattr(gpu_module, "drop_stale", spy)
    hits = shard.search(y[:1], 1, nprobe=16)
    assert held == [False]
    assert hits[0][0][0] == "0"  # id 0's new vector


class FlakyCopies:
    """The copier of a GPU whose first ``fail`` copies after the first one fail (faiss
    raises RuntimeError), and whose first copy fails its first add."""

    def __init__(self, fail: int) -> None:
        self.fail = fail
        self.calls = 0
        self.lib = StrictFaissGpu()  # the options of every copy checked against faiss-gpu

    def __call__(self, cpu_index: faiss.Index) -> FakeGpuIndex:
        self.calls += 1
        gpu_module.cloner_options(self.lib)
        if self.calls == 1:
            return FailingOnce(cpu_index)
        if self.calls <= 1 + self.fail:
            raise RuntimeError("cudaErrorDevicesUnavailable")
        return FakeGpuIndex(cpu_index)


class FailingOnce(FakeGpuIndex):
    def add_with_ids(self, x: np.ndarray, ids: np.ndarray) -> None:
        raise RuntimeError("an illegal memory access was encountered")


def test_a_gpu_error_is_followed_by_a_reattach_with_backoff(
    trained: TrainedIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gpu_module, "gpu_status", lambda: (True, "pretend"))
    waits: list[float] = []
    copies = FlakyCopies(fail=2)
    mirror = GpuMirror(copier=copies, reattach_first_s=0.01)
    real_wait = mirror._closed.wait

    def wait(delay: float) -> bool:
        waits.append(delay)
        return real_wait(delay)

    monkeypatch.setattr(mirror._closed, "wait", wait)
    registry = CollectorRegistry()
    shard = IvfPqShard(trained)
    assert attach_or_fallback(shard, True, 0, GpuMetrics.create(registry, 0, "r0"), mirror)
    labels = {"shard": "0", "replica": "r0"}
    assert registry.get_sample_value("index_gpu_wanted", labels) == 1
    x = unit(200, 64, seed=1)
    shard.apply([Upsert(str(i), x[i]) for i in range(200)], "1-0")  # the add fails
    assert registry.get_sample_value("index_gpu_fallback_total", {**labels, "reason": "add_failed"})
    assert mirror.wait_reattached(30)
    assert waits == [0.01, 0.02, 0.04]  # two failed copies, each doubling the wait
    assert mirror.index is not None and mirror.failure is None and mirror.reattaches == 1
    assert registry.get_sample_value("index_gpu_serving", labels) == 1
    assert registry.get_sample_value("index_gpu_reattaches_total", labels) == 1
    assert mirror.entries == 200  # the copy holds the writes made while it was off
    assert shard.search(x[7:8], 1, nprobe=16)[0][0][0] == "7"
    assert mirror.index.calls  # answered from the copy again


def test_an_index_the_gpu_refuses_is_wanted_and_not_served(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What GtrIndexGpuFallback fires on: wanted 1, serving 0 (no re-attach: the index
    itself is the reason); on a machine without a GPU, wanted is 0."""
    out = tmp_path_factory.mktemp("pq4bits")
    train_index(unit(3000, 64), out, TrainOptions(nlist=16, pq_m=16, pq_bits=4))
    shard = IvfPqShard(TrainedIndex.load(out))
    labels = {"shard": "0", "replica": "r0"}
    for usable, wanted in ((True, 1), (False, 0)):
        monkeypatch.setattr(gpu_module, "gpu_status", lambda u=usable: (u, "pretend"))
        registry = CollectorRegistry()
        assert not attach_or_fallback(shard, True, 0, GpuMetrics.create(registry, 0, "r0"))
        assert registry.get_sample_value("index_gpu_wanted", labels) == wanted
        assert registry.get_sample_value("index_gpu_serving", labels) == 0


def test_close_stops_the_reattach(trained: TrainedIndex) -> None:
    copies = FlakyCopies(fail=10**6)
    mirror = GpuMirror(copier=copies, reattach_first_s=0.01)
    shard = IvfPqShard(trained)
    shard.attach_gpu(mirror)
    x = unit(10, 64, seed=1)
    shard.apply([Upsert(str(i), x[i]) for i in range(10)], "1-0")
    wait_until(lambda: copies.calls > 3, "a few attempts")
    mirror.close()
    assert mirror.wait_reattached(30) and mirror.index is None
