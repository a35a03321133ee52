"""TensorRT plans cached per GPU, and refused on a GPU or TensorRT release they were not built for.

A TensorRT plan runs only on the GPU architecture (compute capability) and in the
TensorRT release that built it; loading it elsewhere fails inside Triton or, worse,
loads and misbehaves. The chart's ``build-plan`` init container therefore calls
:func:`ensure_plan` on the pod's own GPU: the plan lives in
``<cache>/<key>/model.plan`` where the key names the GPU model, its compute capability,
the TensorRT release and the digest of the ONNX export, so a node pool of another GPU
gets a plan of its own and a new export gets a new plan. The export's digest covers its
weights wherever they are: ``model.onnx`` and every external data file it names (torch
writes xl/xxl weights as one file per tensor beside the graph, which alone is the same
for two checkpoints of one architecture). Every plan, cached or just built, is checked
against the device through its ``<plan>.json``
(:class:`~services.encoder.build.tensorrt_build.PlanMeta`: TensorRT version, GPU name,
compute capability) before it is used: a mismatch is :class:`PlanDeviceMismatch`
(FailedPrecondition) and the pod does not start. The same check refuses a plan given
explicitly (``--plan``) that was built somewhere else.

Pods share the cache (a ReadWriteMany claim): a builder writes into a directory of its
own in the cache and publishes it by renaming it to ``<key>`` (atomic; the first builder
wins, a later one uses the winner's plan), and every read checks the plan against the
sha256 its json records (:class:`PlanCorrupt` otherwise: a cached entry that fails is
rebuilt, an explicit ``--plan`` is refused). Hashing costs ~1 s per GB of plan.

The device is read with torch and tensorrt (:func:`current_device`); everything else is
pure and tested on the CPU with a stated device and a stand-in builder.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.errors import FailedPrecondition
from services.encoder.build.plan_meta import PlanMeta, file_sha256, tensorrt_release

log = logging.getLogger(__name__)

PLAN_NAME = "model.plan"


class PlanDeviceMismatch(FailedPrecondition):
    """A plan built for another GPU, compute capability or TensorRT release."""


class PlanCorrupt(FailedPrecondition):
    """A plan whose bytes are not the ones its ``<plan>.json`` describes."""


@dataclass(frozen=True)
class Device:
    """What a plan is tied to: the GPU, its compute capability, the TensorRT release."""

    gpu: str
    compute_capability: str
    tensorrt_version: str

    def slug(self) -> str:
        gpu = re.sub(r"[^a-z0-9]+", "-", self.gpu.lower()).strip("-") or "gpu"
        return f"{gpu}-sm{self.compute_capability}-trt{tensorrt_release(self.tensorrt_version)}"


def current_device() -> Device:
    """The first CUDA GPU of this process and the installed TensorRT (GPU machines only)."""
    from services.encoder.build.tensorrt_build import _device, _require_tensorrt

    trt = _require_tensorrt()
    gpu, capability = _device()
    return Device(gpu, capability, str(trt.__version__))


def _tensors(graph: Any) -> Iterator[Any]:
    """Every tensor of an ONNX graph and its subgraphs (initializers, attributes)."""
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield from (sparse.values, sparse.indices)
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                yield from _tensors(attr.g)
            for sub in attr.graphs:
                yield from _tensors(sub)


def external_data_files(onnx_path: Path) -> list[str]:
    """The external data files ``onnx_path`` names (relative to its folder), sorted."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    model = onnx.load(str(onnx_path), load_external_data=False)
    tensors = [*_tensors(model.graph)]
    for function in model.functions:
        for node in function.node:
            tensors.extend(a.t for a in node.attribute if a.HasField("t"))
    return sorted({ExternalDataInfo(t).location for t in tensors if uses_external_data(t)})


def onnx_digest(onnx_path: Path) -> str:
    """sha256 (16 hex digits) of the export: model.onnx and every external data file it
    names (one shared ``model.onnx.data``, or one file per tensor as torch writes for
    models over 2 GB), each with its name; FailedPrecondition if one is missing."""
    onnx_path = Path(onnx_path)
    digest = hashlib.sha256()
    for name in ["", *external_data_files(onnx_path)]:
        path = onnx_path.parent / name if name else onnx_path
        if not path.is_file():
            raise FailedPrecondition(f"{onnx_path} names external data {name!r}: not found")
        digest.update(name.encode() + b"\0")
        with path.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def plan_key(device: Device, onnx_path: Path) -> str:
    return f"{device.slug()}-onnx{onnx_digest(onnx_path)}"


def check_plan(plan_path: Path, device: Device) -> PlanMeta:
    """The plan's metadata; PlanDeviceMismatch when it was built for another device,
    PlanCorrupt when its bytes are not the ones its json records (or it records none)."""
    meta = PlanMeta.read(plan_path)
    problems = []
    if tensorrt_release(meta.tensorrt_version) != tensorrt_release(device.tensorrt_version):
        problems.append(
            f"TensorRT {meta.tensorrt_version}, this image has {device.tensorrt_version}"
        )
    if meta.compute_capability != device.compute_capability:
        problems.append(
            f"compute capability {meta.compute_capability}, this GPU has "
            f"{device.compute_capability}"
        )
    if meta.gpu != device.gpu:
        problems.append(f"GPU {meta.gpu!r}, this node has {device.gpu!r}")
    if problems:
        raise PlanDeviceMismatch(
            f"{plan_path} was built for {'; '.join(problems)}: a plan runs only where it was "
            "built; remove it (or point the cache elsewhere) and let `encoder ensure-plan` "
            "build one on this GPU"
        )
    if not meta.plan_sha256:
        raise PlanCorrupt(
            f"{plan_path}: its json records no sha256 (built before plans were checksummed): "
            "build it again (`encoder ensure-plan` does so for a cached plan)"
        )
    actual = file_sha256(plan_path)
    if actual != meta.plan_sha256:
        raise PlanCorrupt(
            f"{plan_path} is not the plan its json describes (sha256 {actual[:16]}…, json "
            f"{meta.plan_sha256[:16]}…): a partial or interleaved write"
        )
    return meta


@dataclass(frozen=True)
class EnsuredPlan:
    path: Path
    meta: PlanMeta
    built: bool


def ensure_plan(
    onnx_path: Path,
    cache_dir: Path,
    device: Device,
    build: Callable[[Path], object],
) -> EnsuredPlan:
    """The cached plan of ``device`` for this export, built with ``build(plan_path)`` if
    missing or corrupt; either way checked against ``device`` (PlanDeviceMismatch
    otherwise) and its recorded sha256.

    The build goes to a directory of this builder's own, published by renaming it to
    the key's (the first of concurrent builders wins; the others use its plan).
    """
    cache_dir = Path(cache_dir)
    key = plan_key(device, onnx_path)
    final = cache_dir / key
    plan_path = final / PLAN_NAME
    if plan_path.exists():
        try:
            return EnsuredPlan(plan_path, check_plan(plan_path, device), False)
        except PlanDeviceMismatch:
            raise
        except FailedPrecondition as exc:  # corrupt, or no json: a partial write
            log.warning("cached plan not used, building it again: %s", exc.message)
    cache_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{key}.", suffix=".building", dir=cache_dir))
    try:
        build(work / PLAN_NAME)
        if not (work / PLAN_NAME).exists():
            raise FailedPrecondition(f"the plan builder wrote no {plan_path}")
        meta = check_plan(work / PLAN_NAME, device)
        if final.exists():  # corrupt, or published by another builder meanwhile
            try:
                return EnsuredPlan(plan_path, check_plan(plan_path, device), False)
            except FailedPrecondition:
                stale = tempfile.mkdtemp(prefix=f".{key}.", suffix=".stale", dir=cache_dir)
                os.replace(final, stale)  # onto an empty directory of its own: atomic
                shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(work, final)
        except OSError:  # another builder published first: its plan, if it is sound
            return EnsuredPlan(plan_path, check_plan(plan_path, device), False)
        return EnsuredPlan(plan_path, meta, True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
