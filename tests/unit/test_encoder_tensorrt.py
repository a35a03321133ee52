"""TensorRT builder: which layers stay FP32 (from the ONNX graph), and the build itself."""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest

from services.common.errors import FailedPrecondition
from services.encoder.model import default_model_dir
from services.encoder.profiles import get_profile
from services.encoder.tensorrt_build import (
    NO_TRT_REASON,
    PlanConfig,
    build_plan,
    build_plan_from_model,
    layer_matches,
    select_fp32_nodes,
)
from tests.encoder_fixtures import encoder_base, ensure_onnx, ensure_tiny_t5


def _has_trt_gpu() -> bool:
    if importlib.util.find_spec("tensorrt") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return encoder_base(tmp_path_factory)


@pytest.fixture(scope="module")
def t5_onnx(base: Path) -> onnx.ModelProto:
    return onnx.load(str(ensure_onnx(ensure_tiny_t5(base), base)))


def test_t5_rms_norms_are_pinned_whole(t5_onnx: onnx.ModelProto) -> None:
    selection = select_fp32_nodes(t5_onnx)
    ops = Counter(n.op_type for n in t5_onnx.graph.node if n.name in selection.norms)
    n_norms = 2 * 2 + 1  # two sub-layers per block, two blocks, plus final_layer_norm
    assert ops["Pow"] == ops["ReduceMean"] == ops["Sqrt"] == n_norms
    assert ops["Mul"] == 2 * n_norms  # x * rsqrt(var) and weight * (...)
    assert all("layer_norm" in name for name in selection.norms)
    # nothing of the attention or the FFN body is in a norm
    assert not any(n.op_type in {"Softmax", "MatMul", "Relu"}
                   for n in t5_onnx.graph.node if n.name in selection.norms)  # fmt: skip


def test_t5_residual_adds_and_ffn_output(t5_onnx: onnx.ModelProto) -> None:
    selection = select_fp32_nodes(t5_onnx)
    assert sorted(selection.residual_adds) == [
        f"/backbone/encoder/block.{b}/layer.{l}/Add"
        for b in (0, 1)
        for l in (0, 1)  # noqa: E741
    ]
    assert sorted(selection.ffn_out) == [
        f"/backbone/encoder/block.{b}/layer.1/DenseReluDense/wo/MatMul" for b in (0, 1)
    ]
    assert not select_fp32_nodes(t5_onnx, keep_ffn_out=False).ffn_out
    # pooling, the 2_Dense projection and the normalisation come after the last norm
    tail_ops = {n.op_type for n in t5_onnx.graph.node if n.name in selection.tail}
    assert {"ReduceSum", "MatMul", "ReduceL2", "Div"} <= tail_ops
    # attention-mask adds feed Softmax, not a norm: they are not residuals
    assert not any("SelfAttention" in name for name in selection.residual_adds)


def test_bert_layer_norms_and_residuals(base: Path) -> None:
    graph = onnx.load(str(ensure_onnx(default_model_dir(), base)), load_external_data=False)
    selection = select_fp32_nodes(graph)
    assert len(selection.norms) == 1 + 2 * 6  # embeddings + two per layer
    assert len(selection.residual_adds) == 13
    assert not selection.ffn_out


def test_layer_names_match_nodes_not_their_numbered_siblings() -> None:
    keep = frozenset({"/x/Add", "/x/layer_norm/Pow"})
    assert layer_matches("/x/Add", keep)
    assert layer_matches("/x/layer_norm/Pow_output_cast", keep)
    assert not layer_matches("/x/Add_1", keep)
    assert not layer_matches("/y/Add", keep)


def test_plan_config_follows_the_profile() -> None:
    cfg = PlanConfig.for_profile(get_profile("xxl"))
    assert cfg.min_shape == (1, 1) and cfg.max_shape == (32, 512) and cfg.opt_shape == (8, 128)
    assert PlanConfig.for_profile(get_profile("base")).max_shape == (64, 512)


@pytest.mark.skipif(_has_trt_gpu(), reason="TensorRT and a GPU are present: the build runs")
def test_build_refuses_cleanly_without_tensorrt(base: Path, tmp_path: Path) -> None:
    model_dir = ensure_tiny_t5(base)
    with pytest.raises(FailedPrecondition, match=NO_TRT_REASON):
        build_plan_from_model(model_dir, ensure_onnx(model_dir, base), tmp_path / "model.plan")
    assert not (tmp_path / "model.plan").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not _has_trt_gpu(), reason=NO_TRT_REASON)
def test_fp16_plan_passes_parity_on_tiny_t5(base: Path, tmp_path: Path) -> None:
    model_dir = ensure_tiny_t5(base)
    report = build_plan_from_model(model_dir, ensure_onnx(model_dir, base), tmp_path / "m.plan")
    assert report.plan_path is not None and report.plan_path.exists()
    assert report.min_cosine >= 0.999 and report.fp32_layers > 0


@pytest.mark.gpu
@pytest.mark.skipif(not _has_trt_gpu(), reason=NO_TRT_REASON)
def test_plan_is_not_written_when_parity_fails(base: Path, tmp_path: Path) -> None:
    from services.encoder.tensorrt_build import PlanParityError

    model_dir = ensure_tiny_t5(base)
    ids = np.array([[3, 4, 1]], dtype=np.int64)
    wrong = np.ones((1, 48), dtype=np.float32)  # not the model's output
    with pytest.raises(PlanParityError):
        build_plan(ensure_onnx(model_dir, base), tmp_path / "m.plan", PlanConfig(), ids,
                   np.ones_like(ids), wrong)  # fmt: skip
    assert not (tmp_path / "m.plan").exists()
