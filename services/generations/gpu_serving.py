"""What a rollout keeps of the serving generation's GPU search (issue #37 item 2).

A shard searches on a GPU only when faiss-gpu accepts its IVF-PQ
(:func:`services.index.core.trained.gpu_pq_problem`); a 768-d index trained with the
defaults (pq_m 192) it refuses, and the shard serves from its CPU index. So a new
generation trains with the source's PQ shape (its ``pq_m`` when the dimension is the
same, as it keeps ``pq_bits`` and the refine) and, when the source is *GPU-bound*, with
:attr:`~services.index.core.train.TrainOptions.gpu` (a GPU pq_m for a new dimension, and
a refusal of any other).

The source is GPU-bound when its manifest says it was trained for GPUs (``gpu``: ``index
train --gpu``, or a rollout of such an index) or when any of its replicas answers Stats
with ``gpu`` (it searches from a GPU copy: a ``--gpu`` index trained before the manifest
recorded it, or the chart's GPU shards, whose trained index the rollout Job does not
mount). A rollout whose target could not be searched on a GPU is refused before it
starts (:meth:`~services.generations.builder.RolloutBuilder.rollout`), naming why.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.generations.registry import Generation
from services.generations.replicas import ReplicaStats, all_stats
from services.index.core.train import default_gpu_pq_m
from services.index.core.trained import MANIFEST, gpu_pq_problem

if TYPE_CHECKING:
    from services.rpc.tls import ClientTLS

# How to serve the new generation on CPUs instead, when that is what is wanted.
ON_CPU = "serve on CPUs instead (GTR_SHARD_GPU=false; the chart's index.gpu.enabled=false)"


@dataclass(frozen=True)
class GpuKeep:
    """The training settings a target takes from its source, and whether it can search
    on a GPU as the source does."""

    bound: bool  # the source searches on GPUs (or was trained for them): so must the target
    why: str  # what says so ("" when not bound)
    pq_m: int | None  # the source's pq_m, kept (None: the trainer's default)
    problem: str | None  # why the target cannot be searched on a GPU (None: it can, or unbound)


def source_manifest(index_dir: str) -> dict[str, Any]:
    """The source's ``manifest.json`` ({} when this process cannot read it)."""
    try:
        return dict(json.loads((Path(index_dir) / MANIFEST).read_text()))
    except (OSError, ValueError):
        return {}


def gpu_keep(manifest: dict[str, Any], gpu_replicas: list[str], dim: int) -> GpuKeep:
    """What a ``dim``-d target keeps of a source with ``manifest`` whose ``gpu_replicas``
    search on a GPU (``dim`` 0: not known yet, a checkpoint still to publish)."""
    why = ""
    if manifest.get("gpu"):
        why = "its manifest says it was trained for GPUs (index train --gpu)"
    elif gpu_replicas:
        why = f"replica {gpu_replicas[0]} searches on a GPU"
    src_dim, src_m = int(manifest.get("dim", 0)), manifest.get("pq_m")
    bits = int(manifest.get("pq_bits", 8))
    pq_m = int(src_m) if src_m and dim and src_dim == dim and dim % int(src_m) == 0 else None
    problem: str | None = None
    if why and dim:
        if pq_m is not None:
            problem = gpu_pq_problem(dim, pq_m, bits)
        elif default_gpu_pq_m(dim) is None:
            problem = (
                f"no pq_m GPU IVF-PQ accepts divides {dim} into a quarter of the default "
                "sub-quantizers or more (MIN_GPU_PQ_SHARE)"
            )
        elif bits != 8:
            problem = gpu_pq_problem(dim, default_gpu_pq_m(dim) or 0, bits)
    return GpuKeep(bool(why), why, pq_m, problem)


def refusal(keep: GpuKeep, source: str, dim: int) -> str:
    """The words of a rollout refused for ``keep.problem`` (after the option's name)."""
    return (
        f"would move {source}'s GPU shards onto their CPU indexes: {source} is GPU-bound "
        f"({keep.why}), and a {dim}-d index of the new generation cannot be searched on a "
        f"GPU ({keep.problem}); keep a dimension GPU IVF-PQ accepts, or {ON_CPU}"
    )


async def source_keep(
    source: Generation, spec: str | None, tls: ClientTLS | None, dim: int
) -> GpuKeep:
    """What a ``dim``-d target keeps of ``source`` (its replicas at ``spec`` asked unless
    its manifest already says it is GPU-bound)."""
    manifest = source_manifest(source.index_dir)
    replicas = [] if manifest.get("gpu") else await gpu_replicas(spec, tls)
    return gpu_keep(manifest, replicas, dim)


async def gpu_replicas(spec: str | None, tls: ClientTLS | None) -> list[str]:
    """The addresses in ``spec`` whose Stats say they search on a GPU (replicas that do
    not answer are left out)."""
    if not spec:
        return []
    found = await all_stats(spec, tls)
    return [r.address for shard in found for r in shard if isinstance(r, ReplicaStats) and r.gpu]
