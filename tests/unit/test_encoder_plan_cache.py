"""The TensorRT plan cache of the chart's build-plan init container, on the CPU.

The device is stated and the builder writes a stand-in plan with ``write_plan``, the
writer of ``build_plan``; what is checked is the cache's logic: one plan per GPU, compute
capability, TensorRT release and export (its external weights included), reused without
building, a plan built for another GPU or TensorRT release refused before Triton could
load it, and builders sharing the cache never publishing a plan with another's json.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

import numpy as np
import onnx as onnx_lib
import pytest
from onnx import helper, numpy_helper

from services.common.errors import FailedPrecondition
from services.encoder.build.plan_cache import (
    Device,
    PlanCorrupt,
    PlanDeviceMismatch,
    check_plan,
    ensure_plan,
    external_data_files,
    plan_key,
)
from services.encoder.build.plan_meta import PlanMeta, plan_meta_path, write_plan
from tests.encoder_fixtures import encoder_base, ensure_onnx, ensure_tiny_t5

L4 = Device("NVIDIA L4", "8.9", "10.7.0.23")
A100 = Device("NVIDIA A100-SXM4-40GB", "8.0", "10.7.0.23")


def meta_of(device: Device) -> PlanMeta:
    return PlanMeta(
        device.tensorrt_version,
        "fp16",
        (1, 1),
        (8, 128),
        (64, 512),
        0.9995,
        40,
        device.gpu,
        device.compute_capability,
    )


def put_plan(path: Path, device: Device, engine: bytes = b"engine") -> None:
    write_plan(path, engine, meta_of(device))


class Builder:
    def __init__(self, device: Device, engine: bytes = b"engine") -> None:
        self.device = device
        self.engine = engine
        self.calls: list[Path] = []

    def __call__(self, out: Path) -> None:
        self.calls.append(out)
        put_plan(out, self.device, self.engine)


def save_graph(path: Path, weight: float) -> None:
    """A small valid ONNX graph (y = x + w) whose one initializer is ``weight``."""
    w = numpy_helper.from_array(np.full((4,), weight, dtype=np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", onnx_lib.TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", onnx_lib.TensorProto.FLOAT, [4])],
        [w],
    )
    onnx_lib.save(helper.make_model(graph), str(path))


@pytest.fixture
def onnx(tmp_path: Path) -> Path:
    path = tmp_path / "export" / "model.onnx"
    path.parent.mkdir()
    save_graph(path, 1.0)
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
    save_graph(onnx, 2.0)
    assert key != plan_key(L4, onnx)
    assert plan_key(Device("NVIDIA L4", "8.9", "10.7.0.99"), onnx) == plan_key(L4, onnx)


def test_a_cached_plan_of_another_gpu_is_refused(onnx: Path, tmp_path: Path) -> None:
    """A plan in the L4's cache slot that was in fact built on an A100 never reaches Triton."""
    cache = tmp_path / "cache"
    put_plan(cache / plan_key(L4, onnx) / "model.plan", A100)
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
    put_plan(plan, built_on)
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


def _per_tensor_export(src: Path, out: Path) -> Path:
    """``src`` re-saved as torch saves a model over 2 GB: each initializer in a file of
    its own, named after it."""
    from onnx.external_data_helper import set_external_data, write_external_data_tensors

    out.mkdir(parents=True)
    model = onnx_lib.load(str(src))
    for tensor in model.graph.initializer:
        set_external_data(tensor, location=re.sub(r"[^\w.-]", "_", tensor.name))
    onnx_lib.save(write_external_data_tensors(model, str(out)), str(out / "model.onnx"))
    return out / "model.onnx"


def test_the_key_covers_weights_in_per_tensor_external_data(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Issue #25 item 5: two checkpoints of one architecture exported with external data
    (xl/xxl) have the same model.onnx; the key must still tell them apart."""
    from services.encoder.build.export import export_onnx
    from tests.encoder_fixtures import build_tiny_t5

    base = encoder_base(tmp_path_factory)
    first = ensure_onnx(ensure_tiny_t5(base), base)
    retrained = build_tiny_t5(tmp_path / "tiny-t5-seed1", seed=1)
    second = tmp_path / "second" / "model.onnx"
    export_onnx(retrained, second)
    a = _per_tensor_export(first, tmp_path / "a")
    b = _per_tensor_export(second, tmp_path / "b")
    assert a.read_bytes() == b.read_bytes()  # the graph alone cannot tell them apart
    files = external_data_files(a)
    assert len(files) > 10 and all((a.parent / f).is_file() for f in files)
    assert plan_key(L4, a) != plan_key(L4, b)
    before = plan_key(L4, a)
    weight = a.parent / files[len(files) // 2]
    data = bytearray(weight.read_bytes())
    data[0] ^= 1
    weight.write_bytes(bytes(data))
    assert plan_key(L4, a) != before  # one tensor changed: another plan
    weight.unlink()
    with pytest.raises(FailedPrecondition, match="names external data"):
        plan_key(L4, a)


def test_a_cached_plan_that_is_not_its_jsons_is_rebuilt(onnx: Path, tmp_path: Path) -> None:
    """Item 7: a plan whose json describes another plan (two builders interleaved, or a
    partial write) is never used: the cache builds it again."""
    cache = tmp_path / "cache"
    plan = cache / plan_key(L4, onnx) / "model.plan"
    put_plan(plan, L4, b"engine of builder 1")
    plan.write_bytes(b"engine of builder 2")  # builder 2's plan, builder 1's json
    with pytest.raises(PlanCorrupt, match="not the plan its json describes"):
        check_plan(plan, L4)
    build = Builder(L4, b"engine of builder 3")
    ensured = ensure_plan(onnx, cache, L4, build)
    assert ensured.built and len(build.calls) == 1
    assert ensured.path.read_bytes() == b"engine of builder 3"
    assert check_plan(ensured.path, L4).plan_sha256 == ensured.meta.plan_sha256


def test_concurrent_builders_publish_one_sound_plan(onnx: Path, tmp_path: Path) -> None:
    """Item 7: builders sharing the cache (one per pod) each write under names of their
    own; one plan is published, with its own json, and every builder gets that plan."""
    cache = tmp_path / "cache"
    n = 6
    barrier = threading.Barrier(n)
    results: list[Path] = []
    errors: list[BaseException] = []

    def pod(i: int) -> None:
        def build(out: Path) -> None:
            barrier.wait(10)  # all builders inside the build at once
            put_plan(out, L4, f"engine of pod {i}".encode() * 1000)

        try:
            results.append(ensure_plan(onnx, cache, L4, build).path)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=pod, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert len(set(results)) == 1 and len(results) == n
    (plan,) = set(results)
    check_plan(plan, L4)  # the plan is its json's
    assert sorted(p.name for p in cache.iterdir()) == [plan.parent.name]  # nothing left over
    assert sorted(p.name for p in plan.parent.iterdir()) == ["model.plan", "model.plan.json"]


def test_write_plan_uses_names_of_its_own(tmp_path: Path) -> None:
    """Item 7: two builders writing the same plan path never share a temp file."""
    plan = tmp_path / "model.plan"
    put_plan(plan, L4, b"first")
    put_plan(plan, L4, b"second")
    assert plan.read_bytes() == b"second" and check_plan(plan, L4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.plan", "model.plan.json"]
    assert plan_meta_path(plan).exists()
