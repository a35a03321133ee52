"""The TensorRT plan cache of the chart's build-plan init container, on the CPU.

The device is stated and the builder writes a stand-in plan with the <plan>.json that
`build_plan` writes; what is checked is the cache's logic: one plan per GPU, compute
capability, TensorRT release and export, reused without building, and a plan built for
another GPU or TensorRT release refused before Triton could load it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.errors import FailedPrecondition
from services.encoder.build.plan_cache import (
    Device,
    PlanDeviceMismatch,
    check_plan,
    ensure_plan,
    plan_key,
)
from services.encoder.build.tensorrt_build import PlanMeta

L4 = Device("NVIDIA L4", "8.9", "10.7.0.23")
A100 = Device("NVIDIA A100-SXM4-40GB", "8.0", "10.7.0.23")


def write_plan(path: Path, device: Device) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"engine")
    PlanMeta(device.tensorrt_version, "fp16", (1, 1), (8, 128), (64, 512), 0.9995, 40,
             device.gpu, device.compute_capability).write(path)  # fmt: skip


class Builder:
    def __init__(self, device: Device) -> None:
        self.device = device
        self.calls: list[Path] = []

    def __call__(self, out: Path) -> None:
        self.calls.append(out)
        write_plan(out, self.device)


@pytest.fixture
def onnx(tmp_path: Path) -> Path:
    path = tmp_path / "export" / "model.onnx"
    path.parent.mkdir()
    path.write_bytes(b"onnx graph v1")
    return path


def test_a_missing_plan_is_built_once_then_reused(onnx: Path, tmp_path: Path) -> None:
    build = Builder(L4)
    first = ensure_plan(onnx, tmp_path / "cache", L4, build)
    again = ensure_plan(onnx, tmp_path / "cache", L4, build)
    assert first.built and not again.built
    assert len(build.calls) == 1 and first.path == again.path
    assert first.meta.gpu == "NVIDIA L4" and first.meta.compute_capability == "8.9"


def test_each_gpu_and_export_gets_a_plan_of_its_own(onnx: Path, tmp_path: Path) -> None:
    key = plan_key(L4, onnx)
    assert key != plan_key(A100, onnx)
    assert key != plan_key(Device("NVIDIA L4", "8.9", "10.8.0"), onnx)
    onnx.write_bytes(b"onnx graph v2")
    assert key != plan_key(L4, onnx)
    assert plan_key(Device("NVIDIA L4", "8.9", "10.7.0.99"), onnx) == plan_key(L4, onnx)


def test_a_cached_plan_of_another_gpu_is_refused(onnx: Path, tmp_path: Path) -> None:
    """A plan in the L4's cache slot that was in fact built on an A100 never reaches Triton."""
    cache = tmp_path / "cache"
    write_plan(cache / plan_key(L4, onnx) / "model.plan", A100)
    build = Builder(L4)
    with pytest.raises(PlanDeviceMismatch, match=r"compute capability 8\.0, this GPU has 8\.9"):
        ensure_plan(onnx, cache, L4, build)
    assert build.calls == []


@pytest.mark.parametrize(
    ("built_on", "message"),
    [
        (Device("NVIDIA L4", "8.9", "10.8.0.1"), r"TensorRT 10\.8\.0\.1, this image has 10\.7"),
        (
            Device("NVIDIA L40S", "8.9", "10.7.0.23"),
            r"GPU 'NVIDIA L40S', this node has 'NVIDIA L4'",
        ),
    ],
)
def test_an_explicit_plan_built_elsewhere_is_refused(
    tmp_path: Path, built_on: Device, message: str
) -> None:
    plan = tmp_path / "model.plan"
    write_plan(plan, built_on)
    with pytest.raises(PlanDeviceMismatch, match=message):
        check_plan(plan, L4)


def test_a_plan_without_metadata_is_refused(tmp_path: Path) -> None:
    plan = tmp_path / "model.plan"
    plan.write_bytes(b"engine")
    with pytest.raises(Exception, match=r"has no model\.plan\.json"):
        check_plan(plan, L4)


def test_a_builder_that_writes_nothing_fails(onnx: Path, tmp_path: Path) -> None:
    with pytest.raises(FailedPrecondition, match="wrote no"):
        ensure_plan(onnx, tmp_path / "cache", L4, lambda out: None)
