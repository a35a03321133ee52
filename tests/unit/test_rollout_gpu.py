"""Issue #37 item 2: a rollout of a GPU index keeps GPU serving, or is refused before it
starts (services/generations/gpu_serving.py, phase_train.py, builder.py).

The retrain's training runs for real (768-d, the GTR width) and its index is copied to
the GPU through the faiss-gpu API mirror (tests/support/faiss_gpu.py), as the copy tests
do: before the fix the retrain trained pq_m 192, which faiss-gpu refuses, so every GPU
shard of the new generation served from its CPU index.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from services.generations.errors import PlanRefused
from services.generations.gpu_serving import gpu_keep, source_manifest
from services.generations.phase_train import train
from services.generations.registry import EncoderSpec, Generation, Registry
from services.index.core.gpu import GpuMetrics, GpuMirror, attach_or_fallback
from services.index.core.shard import IvfPqShard
from services.index.core.train import TrainOptions, train_index
from services.index.core.trained import TrainedIndex
from services.index.keys import LAYOUT_KEY
from services.process.redis_client import sync_client
from tests.support.faiss_gpu import StrictFaissGpu, unit

GTR = EncoderSpec("embed", 1, 768, "gtr-t5-base")


@pytest.fixture(scope="module")
def gpu_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """g1: a 768-d index trained with --gpu (pq_m 96)."""
    out = tmp_path_factory.mktemp("g1")
    train_index(unit(400, 768), out, TrainOptions(nlist=4, gpu=True))
    return out


def _ctx(source_dir: Path) -> Any:
    source = Generation("g1", "serving", 1, GTR, str(source_dir), {})
    return SimpleNamespace(
        source=lambda: source, options=SimpleNamespace(sample=100_000, target_recall=None)
    )


def test_the_keep_rule() -> None:
    gpu_768 = {"dim": 768, "pq_m": 96, "pq_bits": 8, "gpu": True}
    keep = gpu_keep(gpu_768, [], 768)
    assert keep.bound and keep.pq_m == 96 and keep.problem is None
    # an index trained with --gpu before the manifest said so: its replicas tell
    old = {"dim": 768, "pq_m": 96, "pq_bits": 8}
    assert not gpu_keep(old, [], 768).bound
    told = gpu_keep(old, ["10.0.0.7:50061"], 768)
    assert told.bound and "10.0.0.7:50061" in told.why and told.problem is None
    # a new encoder's width: a GPU pq_m of its own, or the reason there is none
    assert gpu_keep(gpu_768, [], 1024).pq_m is None
    assert gpu_keep(gpu_768, [], 1024).problem is None
    assert "no pq_m" in (gpu_keep(gpu_768, [], 1001).problem or "")  # only pq_m 1 divides
    # a CPU source keeps its pq_m (same width) and no GPU constraint
    cpu = gpu_keep({"dim": 768, "pq_m": 192, "pq_bits": 8}, [], 768)
    assert not cpu.bound and cpu.pq_m == 192 and cpu.problem is None
    # unknown width (a checkpoint still to publish): decided at train
    assert gpu_keep(gpu_768, [], 0).problem is None


@pytest.mark.parametrize("signal", ["manifest", "replica"])
def test_a_retrain_of_a_gpu_index_is_copied_to_the_gpu(
    gpu_source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, signal: str
) -> None:
    import services.index.core.gpu as gpu_module

    manifest = source_manifest(str(gpu_source))
    if signal == "replica":  # g1's manifest without the flag, a replica on a GPU
        manifest["gpu"] = False
    keep = gpu_keep(manifest, ["g1-0:50061"] if signal == "replica" else [], 768)
    target = Generation("g2", "building", 1, GTR, str(tmp_path / "g2"), {})
    made = train(_ctx(gpu_source), target, unit(400, 768, seed=5), keep)
    assert made.pq_m == 96 and made.gpu_problem is None and made.gpu

    trained = TrainedIndex.load(tmp_path / "g2")
    lib = StrictFaissGpu()
    monkeypatch.setattr(gpu_module, "gpu_status", lambda: (True, "1 GPU(s) visible to faiss"))
    registry = CollectorRegistry()
    metrics = GpuMetrics.create(registry, 0, "g2-0")
    shard = IvfPqShard(trained)
    assert attach_or_fallback(shard, True, 0, metrics, GpuMirror(lib=lib))
    assert len(lib.copies) == 1
    assert registry.get_sample_value("index_gpu_serving", {"shard": "0", "replica": "g2-0"}) == 1


def test_without_the_source_settings_the_retrain_would_serve_from_cpus(
    gpu_source: Path, tmp_path: Path
) -> None:
    """What the rollout did before: neither pq_m nor gpu, so pq_m 192 for 768-d."""
    target = Generation("g2", "building", 1, GTR, str(tmp_path / "g2"), {})
    unbound = gpu_keep({}, [], 768)
    made = train(_ctx(gpu_source), target, unit(400, 768, seed=5), unbound)
    assert made.pq_m == 192 and "not 192" in (made.gpu_problem or "")


@pytest.fixture
def store(redis_url: str, gpu_source: Path) -> Iterator[Any]:
    client = sync_client(redis_url)
    client.hset(LAYOUT_KEY, mapping={"version": "2", "shards": "1"})
    Registry(client).ensure_first(1, GTR, str(gpu_source))
    yield client
    client.close()


def test_a_rollout_that_would_lose_gpu_serving_is_refused_before_it_starts(
    store: Any, tmp_path: Path
) -> None:
    from services.cli.generation_places import in_flags
    from services.common.errors import InvalidArgument
    from services.generations.builder import RolloutBuilder, RolloutOptions, RolloutPlan

    async def no_encoder(spec: EncoderSpec) -> Any:
        raise AssertionError("a refused plan encodes nothing")

    builder = RolloutBuilder(store, no_encoder, RolloutOptions(index_root=tmp_path))
    wide = EncoderSpec("embed", 2, 1001, "odd-width")
    with pytest.raises(PlanRefused) as refused:
        asyncio.run(builder.rollout(RolloutPlan(encoder=wide)))
    assert refused.value.option == "encoder"
    assert "GPU shards onto their CPU indexes" in refused.value.message
    assert "index.gpu.enabled=false" in refused.value.message
    assert builder.store.load() is None and [g.name for g in builder.registry.all()] == ["g1"]
    with pytest.raises(InvalidArgument, match=r"^--encoder would move g1's GPU shards"), in_flags():
        asyncio.run(builder.rollout(RolloutPlan(encoder=wide)))
