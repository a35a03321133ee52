"""What a trained encoder architecture (``encoder train --arch``) costs in Triton.

SDE serves one set of weights for queries and documents. The asymmetric variants load
two towers into every Triton instance (``embed`` with ``model.onnx`` and
``document.onnx``; on GPU, a plan per tower): the weights double, minus what the towers
share — ADE-STE / ADE-FTE one token-embedding table, ADE-SPL one projection layer
(d×d). Compute per text does not change: a query runs the query tower only, a
document the document tower only. So the cost is memory (GPU memory per instance, or
host RAM on CPU) and load time, not latency or GPUs.

Weights are counted from the size profile's parameters
(:mod:`services.encoder.profiles`): FP16 in a TensorRT plan (2 bytes per parameter),
FP32 in the CPU ONNX graph (4 bytes). The embedding table is vocabulary × d_model (T5:
32,128 × 768 for base, × 1,024 for large/xl/xxl; MiniLM: 30,522 × 384).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.errors import InvalidArgument
from services.encoder.profiles import PROFILES, ModelProfile

ARCHS = ("sde", "ade", "ade-ste", "ade-fte", "ade-spl")
GIB = 1024**3


def _embedding_params(p: ModelProfile) -> float:
    if p.family == "bert":
        return 30_522 * p.dim
    return 32_128 * (768 if p.name == "base" else 1024)


def tower_params(p: ModelProfile, arch: str) -> float:
    """Parameters an instance holds for ``arch`` (shared modules counted once)."""
    if arch not in ARCHS:
        raise InvalidArgument(f"unknown encoder arch {arch!r}: use one of {', '.join(ARCHS)}")
    one = p.params_millions * 1e6
    if arch == "sde":
        return one
    if arch in ("ade-ste", "ade-fte"):
        return 2 * one - _embedding_params(p)
    if arch == "ade-spl":
        return 2 * one - p.dim * p.dim  # one shared d×d projection
    return 2 * one


@dataclass(frozen=True)
class TowerRow:
    size: str
    params_millions: float  # what one instance holds
    gpu_gib_per_instance: float  # FP16 plan(s)
    gpu_gib_per_gpu: float  # × the profile's instances per GPU
    cpu_gib_per_instance: float  # FP32 ONNX graph(s)
    vs_sde: float


def tower_table(arch: str) -> list[TowerRow]:
    """One row per size profile: the weights ``arch`` puts in a Triton instance."""
    rows = []
    for p in PROFILES.values():
        params = tower_params(p, arch)
        rows.append(
            TowerRow(
                p.name,
                params / 1e6,
                params * 2 / GIB,
                params * 2 * p.triton_instances / GIB,
                params * 4 / GIB,
                params / tower_params(p, "sde"),
            )
        )
    return rows
