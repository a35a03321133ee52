"""The GPU path: used where faiss sees a GPU, skipped with its reason elsewhere."""

from __future__ import annotations

import numpy as np
import pytest

from services.index.changes import Upsert
from services.index.gpu import GpuMirror, gpu_status
from services.index.shard import IvfPqShard
from services.index.train import TrainedIndex, TrainOptions, train_index


def test_gpu_status_always_gives_a_reason() -> None:
    usable, reason = gpu_status()
    assert isinstance(usable, bool) and reason


def test_gpu_copy_answers_like_the_cpu_index(tmp_path) -> None:
    usable, reason = gpu_status()
    if not usable:
        pytest.skip(f"GPU path not available: {reason}")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4000, 64)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
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
