"""TensorRT plans cached per GPU, and refused on a GPU or TensorRT release they were not built for.

A TensorRT plan runs only on the GPU architecture (compute capability) and in the
TensorRT release that built it; loading it elsewhere fails inside Triton or, worse,
loads and misbehaves. The chart's ``build-plan`` init container therefore calls
:func:`ensure_plan` on the pod's own GPU: the plan lives in
``<cache>/<key>/model.plan`` where the key names the GPU model, its compute capability,
the TensorRT release and the digest of the ONNX export, so a node pool of another GPU
gets a plan of its own and a new export gets a new plan. Every plan, cached or just
built, is checked against the device through its ``<plan>.json``
(:class:`~services.encoder.build.tensorrt_build.PlanMeta`: TensorRT version, GPU name,
compute capability) before it is used: a mismatch is :class:`PlanDeviceMismatch`
(FailedPrecondition) and the pod does not start. The same check refuses a plan given
explicitly (``--plan``) that was built somewhere else.

The device is read with torch and tensorrt (:func:`current_device`); everything else is
pure and tested on the CPU with a stated device and a stand-in builder.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from services.common.errors import FailedPrecondition
from services.encoder.build.tensorrt_build import PlanMeta, tensorrt_release

PLAN_NAME = "model.plan"


class PlanDeviceMismatch(FailedPrecondition):
    """A plan built for another GPU, compute capability or TensorRT release."""


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


def onnx_digest(onnx_path: Path) -> str:
    """sha256 (16 hex digits) of the export: model.onnx and its external data file, if any."""
    digest = hashlib.sha256()
    for path in (onnx_path, onnx_path.with_name(onnx_path.name + ".data")):
        if path.exists():
            with path.open("rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    digest.update(block)
    return digest.hexdigest()[:16]


def plan_key(device: Device, onnx_path: Path) -> str:
    return f"{device.slug()}-onnx{onnx_digest(onnx_path)}"


def check_plan(plan_path: Path, device: Device) -> PlanMeta:
    """The plan's metadata, or PlanDeviceMismatch when it was built for another device."""
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
    missing; either way checked against ``device`` (PlanDeviceMismatch otherwise)."""
    plan_path = cache_dir / plan_key(device, onnx_path) / PLAN_NAME
    built = False
    if not plan_path.exists():
        plan_path.parent.mkdir(parents=True, exist_ok=True)
        build(plan_path)
        built = True
        if not plan_path.exists():
            raise FailedPrecondition(f"the plan builder wrote no {plan_path}")
    return EnsuredPlan(plan_path, check_plan(plan_path, device), built)
