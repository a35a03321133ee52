"""The trained, empty index every shard starts from: its files, its manifest, loading it.

``<dir>/trained.faiss`` (the IVF-PQ index), ``<dir>/refine.faiss`` (an empty SQ8 index
that holds the trained scalar quantizer) and ``<dir>/manifest.json`` (:class:`Manifest`),
written by :func:`services.index.core.train.train_index` and loaded by
:meth:`TrainedIndex.load`; what faiss-gpu accepts of it (:func:`gpu_pq_problem`) and the
PQ reconstruction error a shard tracks (:func:`pq_error`). Training imports the shard (it
tunes nprobe through the shard's search path); the shard and its GPU copy import this.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import faiss
import numpy as np

from services.common.errors import FailedPrecondition

MANIFEST = "manifest.json"
TRAINED = "trained.faiss"
REFINE = "refine.faiss"


@dataclass
class Manifest:
    dim: int
    metric: str
    factory: str
    model: str
    nlist: int
    pq_m: int
    pq_bits: int
    refine: bool
    refine_factor: int
    nprobe: int
    train_points: int
    train_pq_error: float  # mean squared reconstruction error of the training sample
    train_seconds: float
    created_at: str
    stats: dict[str, float] = field(default_factory=dict)
    gpu_problem: str | None = None  # why faiss-gpu cannot hold this index (None: it can)
    # trained for GPU shards (`index train --gpu`, or a rollout of such an index): a new
    # generation keeps GPU settings (services/generations/gpu_serving.py)
    gpu: bool = False
    # nprobe tuning (None in manifests written before it, or when the sample was too small)
    target_recall: float | None = None  # None: nprobe was set by hand (--nprobe)
    measured_recall: float | None = None  # 10-recall@10 at `nprobe`, held-out sample
    recall_by_nprobe: dict[str, float] = field(default_factory=dict)  # every nprobe tried
    wide_k: int = 0  # the wide recall's k (WIDE_K, fewer on a tiny sample); 0: not measured
    measured_wide_recall: float | None = None  # wide_k-recall@wide_k at `nprobe`
    wide_recall_by_nprobe: dict[str, float] = field(default_factory=dict)
    tune_queries: int = 0
    tune_seconds: float = 0.0
    flat_ms_per_query: float | None = None  # exact IndexFlatIP over the same vectors
    ivf_ms_per_query: float | None = None  # the shard's search path at `nprobe`
    ivf_advice: str | None = None  # why a flat index would serve this corpus better

    def write(self, directory: Path) -> None:
        (directory / MANIFEST).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def read(cls, directory: Path) -> Manifest:
        path = Path(directory) / MANIFEST
        if not path.exists():
            raise FailedPrecondition(f"{directory} has no {MANIFEST}: run `index train` first")
        return cls(**json.loads(path.read_text()))


# What GPU IVF-PQ accepts (faiss/gpu/GpuIndexIVFPQ.cu, verifyPQSettings_, without cuVS and
# with the cloner's default non-interleaved layout): 8 bits per code; a code length in
# IVFPQ::isSupportedPQCodeLength (56, 64 and 96 only with float16 lookup tables, which
# GpuMirror uses: 2 bytes x pq_m x 256 codes must fit the 48 KiB of shared memory per
# block); pq_m dividing the dimension. Any number of dims per sub-quantizer: faiss 1.6.4
# (2020-10-12, CHANGELOG "Arbitrary dimensions per sub-quantizer now allowed for
# GpuIndexIVFPQ") dropped the fixed list this module used to check (which refused e.g.
# pq_m 16 at 768-d, 48 dims per sub-quantizer).
GPU_PQ_M = (1, 2, 3, 4, 8, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64, 96)
GPU_PQ_M_FLOAT16_ONLY = (56, 64, 96)


def gpu_pq_problem(dim: int, pq_m: int, pq_bits: int) -> str | None:
    """Why faiss-gpu would refuse an IVF-PQ of these settings, or None if it accepts it."""
    if pq_bits != 8:
        return f"GPU IVF-PQ needs 8 bits per code (pq_bits={pq_bits})"
    if pq_m not in GPU_PQ_M:
        return f"GPU IVF-PQ supports pq_m in {list(GPU_PQ_M)}, not {pq_m}"
    if dim % pq_m:
        return f"GPU IVF-PQ needs pq_m to divide the dimension ({pq_m} does not divide {dim})"
    return None


def pq_error(index: faiss.Index, x: np.ndarray) -> float:
    """Mean squared error of encoding then decoding ``x`` with the trained IVF-PQ codec."""
    if len(x) == 0:
        return 0.0
    codes = index.sa_encode(x)
    return float(np.mean(np.sum((index.sa_decode(codes) - x) ** 2, axis=1)))


@dataclass
class TrainedIndex:
    manifest: Manifest
    index: faiss.Index  # IndexIVFPQ, empty
    refine: faiss.Index  # an empty IndexScalarQuantizer; owns the trained SQ8 codec

    @property
    def sq(self) -> faiss.ScalarQuantizer:
        # Non-owning references into ``refine``: keep ``refine`` alive while they are used.
        return faiss.downcast_index(self.refine).sq  # type: ignore[attr-defined]

    @classmethod
    def load(cls, directory: Path) -> TrainedIndex:
        directory = Path(directory)
        manifest = Manifest.read(directory)
        index = faiss.read_index(str(directory / TRAINED))
        refine = faiss.read_index(str(directory / REFINE))
        return cls(manifest, index, refine)
