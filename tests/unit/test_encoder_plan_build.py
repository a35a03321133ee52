"""Issue #37 item 5: the plan build's memory and disk, with a stand-in for TensorRT.

No TensorRT or GPU here: ``FakeTrt`` has the names the build calls (checked against
TensorRT's Python API by name only: Builder, OnnxParser, Runtime, ...). It lets the CPU
check what the build does with its biggest buffers: the ONNX graph is no longer held when
TensorRT parses the file; the serialized engine is written to disk from TensorRT's own
buffer, never copied with ``bytes()``; the previous attempt's engine is freed before the
next is built; an FP32 fallback larger than ``--max-plan-bytes`` (the chart's
planStorage) is refused, naming the setting. The real build on a GPU is in
test_encoder_tensorrt.py (skipped without one) and docs/deploy.md, checklist rows 5 and 9.
"""

from __future__ import annotations

import sys
import weakref
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import onnx
import pytest

import services.encoder.build.tensorrt_build as trt_build
from services.common.errors import InvalidArgument
from services.encoder.build.plan_meta import PlanMeta, file_sha256
from services.encoder.build.tensorrt_build import (
    PlanConfig,
    PlanParityError,
    build_plan,
    fp32_plan_bytes,
    plan_attempts,
)
from tests.encoder_fixtures import encoder_base, ensure_onnx, ensure_tiny_t5

ENGINE = b"\x00engine" * 1000


class NoCopyBuffer(bytearray):
    """TensorRT's IHostMemory: a buffer; ``bytes()`` of it is the copy the build avoids."""

    def __bytes__(self) -> bytes:
        raise AssertionError("the serialized engine was copied with bytes()")


class FakeEngine:
    alive: ClassVar[weakref.WeakSet[FakeEngine]] = weakref.WeakSet()

    def __init__(self) -> None:
        FakeEngine.alive.add(self)

    def create_engine_inspector(self) -> Any:
        class Inspector:
            def get_engine_information(self, fmt: Any) -> str:
                return '{"Layers": []}'

        return Inspector()


class FakeTrt:
    """The TensorRT names the build uses; records what was alive when."""

    __version__ = "10.7.0.23"
    parsed_with_graphs: ClassVar[list[int]] = []
    engines_alive_at_build: ClassVar[list[int]] = []

    class Logger:
        WARNING = 2

        def __init__(self, level: int) -> None:
            pass

    class NetworkDefinitionCreationFlag:
        STRONGLY_TYPED = 1

    class BuilderFlag:
        TF32 = 0

    class MemoryPoolType:
        WORKSPACE = 0

    class ProfilingVerbosity:
        DETAILED = 2

    class LayerInformationFormat:
        JSON = 1

    class OnnxParser:
        def __init__(self, network: Any, logger: Any) -> None:
            self.num_errors = 0

        def parse_from_file(self, path: str) -> bool:
            assert Path(path).exists()
            FakeTrt.parsed_with_graphs.append(sum(1 for g in LOADED if sys.getrefcount(g) > 3))
            return True

    class Builder:
        def __init__(self, logger: Any) -> None:
            pass

        def create_network(self, flags: int) -> Any:
            return type("Network", (), {"num_layers": 7})()

        def create_builder_config(self) -> Any:
            nothing = {
                name: lambda *a: None
                for name in ("clear_flag", "set_memory_pool_limit", "add_optimization_profile")
            }
            return type("Config", (), nothing)()

        def create_optimization_profile(self) -> Any:
            return type("Profile", (), {"set_shape": lambda s, *a: None})()

        def build_serialized_network(self, network: Any, config: Any) -> NoCopyBuffer:
            FakeTrt.engines_alive_at_build.append(len(FakeEngine.alive))
            return NoCopyBuffer(ENGINE)

    class Runtime:
        def __init__(self, logger: Any) -> None:
            pass

        def deserialize_cuda_engine(self, buffer: Any) -> FakeEngine:
            assert bytes(memoryview(buffer)) == ENGINE
            return FakeEngine()


LOADED: list[Any] = []


@pytest.fixture
def fake_build(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """build_plan with FakeTrt; the probe's output is chosen per precision."""
    outputs: dict[str, np.ndarray] = {}
    precisions: list[str] = []
    real_load = onnx.load

    def load(path: str, *args: Any, **kwargs: Any) -> Any:
        model = real_load(path, *args, **kwargs)
        if kwargs.get("load_external_data", True):
            LOADED.append(model)
        return model

    def build_engine(trt: Any, onnx_file: Path, cfg: Any, precision: Any, out: Path) -> Any:
        precisions.append(precision)
        return real_build(trt, onnx_file, cfg, precision, out)

    real_build = trt_build._build_engine
    LOADED.clear()
    FakeTrt.parsed_with_graphs, FakeTrt.engines_alive_at_build = [], []
    monkeypatch.setattr(onnx, "load", load)
    monkeypatch.setattr(trt_build, "_require_tensorrt", lambda: FakeTrt)
    monkeypatch.setattr(trt_build, "_build_engine", build_engine)
    monkeypatch.setattr(trt_build, "_device", lambda: ("Fake GPU", "8.6"))
    monkeypatch.setattr(
        trt_build, "_run_engine", lambda trt, engine, ids, mask: outputs[precisions[-1]]
    )
    return {"outputs": outputs, "precisions": precisions}


@pytest.fixture(scope="module")
def t5_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = encoder_base(tmp_path_factory)
    return ensure_onnx(ensure_tiny_t5(base), base)


def _probe() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ids = np.ones((2, 4), np.int64)
    reference = np.eye(2, 8, dtype=np.float32)
    return ids, ids.copy(), reference


def test_the_graph_is_dropped_and_the_engine_written_from_its_buffer(
    fake_build: dict[str, Any], t5_export: Path, tmp_path: Path
) -> None:
    ids, mask, reference = _probe()
    wrong = np.ones_like(reference)
    fake_build["outputs"].update(fp16=wrong, fp32=reference)  # FP16 fails the gate
    plan = tmp_path / "cache" / "model.plan"
    report = build_plan(t5_export, plan, PlanConfig(), ids, mask, reference)
    assert fake_build["precisions"] == ["fp16", "fp32"] and report.precision == "fp32"
    assert FakeTrt.parsed_with_graphs == [0, 0]  # no ONNX graph held while TensorRT parses
    assert FakeTrt.engines_alive_at_build == [0, 0]  # FP16's engine freed before FP32's
    assert plan.read_bytes() == ENGINE
    meta = PlanMeta.read(plan)
    assert meta.precision == "fp32" and meta.plan_sha256 == file_sha256(plan)
    assert sorted(p.name for p in plan.parent.iterdir()) == ["model.plan", "model.plan.json"]


def test_an_fp32_fallback_larger_than_plan_storage_is_refused_naming_it(
    fake_build: dict[str, Any], t5_export: Path, tmp_path: Path
) -> None:
    ids, mask, reference = _probe()
    fake_build["outputs"].update(fp16=np.ones_like(reference), fp32=reference)
    small = PlanConfig(max_plan_bytes=fp32_plan_bytes(t5_export) - 1)
    plan = tmp_path / "model.plan"
    with pytest.raises(PlanParityError, match="planStorage") as refused:
        build_plan(t5_export, plan, small, ids, mask, reference)
    assert "FP32 fallback refused" in refused.value.message
    assert fake_build["precisions"] == ["fp16"]  # FP32 never built
    assert not plan.exists() and not list(tmp_path.glob(".model.plan*"))  # nothing left
    roomy = PlanConfig(max_plan_bytes=fp32_plan_bytes(t5_export))
    assert build_plan(t5_export, plan, roomy, ids, mask, reference).precision == "fp32"


def test_the_fp32_size_and_the_attempts() -> None:
    fp16_only = PlanConfig(precision="fp16", max_plan_bytes=1)
    assert plan_attempts(fp16_only, 10**10) == (("fp16",), "")
    assert plan_attempts(PlanConfig(), 10**10) == (("fp16", "fp32"), "")
    attempts, why = plan_attempts(PlanConfig(max_plan_bytes=4 * 2**30), int(4.9e9))
    assert attempts == ("fp16",) and "~4.9 GB" in why and "planStorage" in why
    with pytest.raises(InvalidArgument, match="--precision fp32 refused"):
        plan_attempts(PlanConfig(precision="fp32", max_plan_bytes=16 * 2**30), int(19e9))


def test_the_fp32_size_counts_external_data(t5_export: Path, tmp_path: Path) -> None:
    model = onnx.load(str(t5_export))
    split = tmp_path / "model.onnx"
    onnx.save_model(model, str(split), save_as_external_data=True, location="w.data")
    total = split.stat().st_size + (tmp_path / "w.data").stat().st_size
    assert fp32_plan_bytes(split) == total > split.stat().st_size
