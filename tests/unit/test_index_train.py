"""Training: defaults follow the corpus, every knob can be set, the manifest says what."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from services.common.errors import FailedPrecondition, InvalidArgument
from services.index.core.train import (
    Manifest,
    TrainedIndex,
    TrainOptions,
    default_gpu_pq_m,
    default_nlist,
    default_pq_m,
    gpu_pq_problem,
    resolve,
    train_index,
)


def test_defaults_follow_the_corpus_size_and_dimension() -> None:
    assert default_nlist(1_000_000) == 4000
    assert default_nlist(50_000) == int(4 * 50_000**0.5)
    assert default_nlist(5183) == 5183 // 39  # small corpus: enough points per centroid
    assert default_nlist(10) == 1
    for dim in (384, 768, 1024, 100, 7):
        m = default_pq_m(dim)
        assert dim % m == 0
    assert default_pq_m(384) == 96
    assert default_pq_m(768) == 192


def test_resolve_rejects_impossible_settings() -> None:
    with pytest.raises(InvalidArgument, match="divide"):
        resolve(TrainOptions(pq_m=7), 1000, 384)
    with pytest.raises(InvalidArgument, match="nlist"):
        resolve(TrainOptions(nlist=2000), 1000, 384)
    opts = resolve(TrainOptions(nlist=64, pq_m=96, nprobe=8), 5000, 384)
    assert (opts.nlist, opts.pq_m, opts.nprobe) == (64, 96, 8)


def test_train_writes_a_trained_empty_index_and_manifest(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3000, 32)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    manifest = train_index(x, tmp_path, TrainOptions(nlist=16, pq_m=8, model="test-model"))
    assert manifest.factory == "IVF16,PQ8x8,Refine(SQ8)"
    assert manifest.metric == "IP" and manifest.dim == 32 and manifest.model == "test-model"
    assert manifest.train_pq_error > 0
    assert json.loads((tmp_path / "manifest.json").read_text())["nlist"] == 16
    trained = TrainedIndex.load(tmp_path)
    assert trained.index.is_trained and trained.index.ntotal == 0
    assert Manifest.read(tmp_path) == manifest


def test_train_rejects_bad_vectors_and_missing_manifest(tmp_path: Path) -> None:
    bad = np.ones((100, 8), dtype=np.float32)
    bad[3, 2] = np.nan
    with pytest.raises(InvalidArgument, match="NaN"):
        train_index(bad, tmp_path, TrainOptions(nlist=2, pq_m=2))
    with pytest.raises(FailedPrecondition, match="index train"):
        Manifest.read(tmp_path / "nothing")


# --- GPU compatibility (faiss-gpu's IVF-PQ kernels): checked where no GPU is -------------


def test_gpu_pq_rules() -> None:
    assert gpu_pq_problem(384, 96, 8) is None  # the MiniLM default: 4 dims per code
    assert gpu_pq_problem(768, 96, 8) is None
    assert "not 192" in (gpu_pq_problem(768, 192, 8) or "")  # the 768-d default
    assert "8 bits" in (gpu_pq_problem(768, 96, 4) or "")
    assert "dims per sub-quantizer" in (gpu_pq_problem(768, 8, 8) or "")  # 96 dims per code


def test_gpu_training_replaces_an_incompatible_default_pq_m() -> None:
    assert default_pq_m(768) == 192
    assert default_gpu_pq_m(768) == 96 and default_gpu_pq_m(1024) == 64
    opts = resolve(TrainOptions(gpu=True), 5000, 768)
    assert opts.pq_m == 96 and gpu_pq_problem(768, opts.pq_m, opts.pq_bits) is None
    assert resolve(TrainOptions(), 5000, 768).pq_m == 192  # CPU deployments keep dim/4


def test_gpu_training_refuses_settings_the_gpu_refuses() -> None:
    with pytest.raises(InvalidArgument, match="--gpu: GPU IVF-PQ supports pq_m"):
        resolve(TrainOptions(gpu=True, pq_m=192), 5000, 768)
    with pytest.raises(InvalidArgument, match="8 bits"):
        resolve(TrainOptions(gpu=True, pq_bits=4), 5000, 768)


def test_cpu_training_warns_and_records_the_gpu_problem(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    x = np.random.default_rng(0).standard_normal((300, 48)).astype(np.float32)
    with caplog.at_level("WARNING", logger="services.index.core.train"):
        manifest = train_index(x, tmp_path, TrainOptions(nlist=2, pq_m=24, pq_bits=4))
    assert manifest.gpu_problem is not None and "8 bits" in manifest.gpu_problem
    assert "cannot be searched on a GPU" in caplog.text
    assert Manifest.read(tmp_path).gpu_problem == manifest.gpu_problem
    ok = train_index(x, tmp_path / "gpu", TrainOptions(nlist=2, gpu=True, pq_bits=8))
    assert ok.gpu_problem is None and ok.pq_m == default_gpu_pq_m(48)
