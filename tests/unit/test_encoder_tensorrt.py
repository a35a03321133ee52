"""TensorRT builder: which nodes stay FP32, the FP16 cast, the parity gate, the plan's metadata.

Everything up to the engine itself runs here without a GPU: the FP16 graph that TensorRT
would build from is executed in ONNX Runtime on the CPU.
"""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest

from services.common.errors import FailedPrecondition
from services.encoder.build.onnx_fp16 import fp16_graph, select_fp32_nodes
from services.encoder.build.plan_meta import PlanMeta, PlanVersionMismatch
from services.encoder.build.tensorrt_build import (
    MORE_FP32_HINT,
    NO_TRT_REASON,
    PLAN_MIN_COSINE,
    PlanConfig,
    build_plan,
    build_plan_from_model,
    check_embeddings,
    fp16_layers_of_kept_nodes,
    layers_with_onnx_names,
    probe_tokens,
)
from services.encoder.model import default_model_dir
from services.encoder.profiles import get_profile
from tests.encoder_fixtures import build_tiny_t5, encoder_base, ensure_onnx, ensure_tiny_t5


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
    assert not any(
        n.op_type in {"Softmax", "MatMul", "Relu"}
        for n in t5_onnx.graph.node
        if n.name in selection.norms
    )


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


def report_shape(model_dir: Path) -> tuple[int, int]:
    from services.encoder.profiles import profile_for_model_dir

    return PlanConfig.for_profile(profile_for_model_dir(model_dir)).max_shape


@pytest.mark.gpu
@pytest.mark.skipif(
    not _has_trt_gpu(),
    reason=f"{NO_TRT_REASON} (covers issue #25 items 7 and 10 on a GPU: a real build's "
    "sha256 in <plan>.json, checked on read, no temp file left, its precision)",
)
def test_fp16_plan_passes_parity_on_tiny_t5(base: Path, tmp_path: Path) -> None:
    from services.encoder.build.plan_cache import check_plan, current_device

    model_dir = ensure_tiny_t5(base)
    report = build_plan_from_model(model_dir, ensure_onnx(model_dir, base), tmp_path / "m.plan")
    assert report.plan_path is not None and report.plan_path.exists()
    assert report.min_cosine >= 0.999 and report.fp32_layers > 0
    meta = PlanMeta.read(report.plan_path)
    assert meta.precision == "fp16" and meta.max_shape == report_shape(model_dir)
    assert report.inspected_layers > 0  # else the inspector check saw nothing
    assert check_plan(report.plan_path, current_device()).plan_sha256 == meta.plan_sha256
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.plan", "m.plan.json"]


def test_the_torch_model_is_freed_before_the_plan_build(
    base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue #25 item 6: the FP32 PyTorch model (19 GB for xxl) is gone from host memory
    before TensorRT builds (which holds the FP32 ONNX graph and its FP16 copy). TensorRT
    cannot run here: the build itself is replaced by a probe of what is still alive."""
    import gc
    import weakref

    import services.encoder.build.tensorrt_build as trt_build
    import services.encoder.model as model_module

    modules: list[weakref.ref[object]] = []

    class Tracked(model_module.TorchEmbedder):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            modules.append(weakref.ref(self.module))

    alive: list[bool] = []

    def build(onnx_path: Path, plan_path: Path, cfg: object, *rest: object) -> str:
        gc.collect()
        alive.extend(ref() is not None for ref in modules)
        return "built"

    monkeypatch.setattr(model_module, "TorchEmbedder", Tracked)
    monkeypatch.setattr(trt_build, "_require_tensorrt", lambda: None)
    monkeypatch.setattr(trt_build, "build_plan", build)
    model_dir = ensure_tiny_t5(base)
    onnx_path = ensure_onnx(model_dir, base)
    modules.clear()
    cfg = PlanConfig(opt_shape=(2, 16), max_shape=(2, 16))
    result = trt_build.build_plan_from_model(model_dir, onnx_path, tmp_path / "model.plan", cfg)
    assert result == "built"  # type: ignore[comparison-overlap]
    assert alive == [False]


@pytest.mark.gpu
@pytest.mark.skipif(
    not _has_trt_gpu(),
    reason=f"{NO_TRT_REASON} (covers issue #25 item 7 on a GPU: a refused build leaves no file)",
)
def test_plan_is_not_written_when_parity_fails(base: Path, tmp_path: Path) -> None:
    from services.encoder.build.tensorrt_build import PlanParityError

    model_dir = ensure_tiny_t5(base)
    ids = np.array([[3, 4, 1]], dtype=np.int64)
    wrong = np.ones((1, 48), dtype=np.float32)  # not the model's output
    with pytest.raises(PlanParityError):
        build_plan(
            ensure_onnx(model_dir, base),
            tmp_path / "m.plan",
            PlanConfig(),
            ids,
            np.ones_like(ids),
            wrong,
        )
    assert not (tmp_path / "m.plan").exists() and not list(tmp_path.iterdir())


# --- the parity gate -------------------------------------------------------------------


def _unit_rows(n: int, dim: int, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_gate_passes_the_reference_itself() -> None:
    ref = _unit_rows(4, 16)
    cosine, failure = check_embeddings(ref, ref * 3.0, PLAN_MIN_COSINE)
    assert failure is None and cosine == pytest.approx(1.0, abs=1e-6)


def test_gate_refuses_all_zero_output() -> None:
    ref = _unit_rows(4, 16)
    cosine, failure = check_embeddings(ref, np.zeros_like(ref), PLAN_MIN_COSINE)
    assert failure is not None and "4/4 rows are all zeros" in failure
    assert not cosine >= PLAN_MIN_COSINE


def test_gate_refuses_one_zero_row() -> None:
    ref = _unit_rows(4, 16)
    got = ref.copy()
    got[2] = 0.0
    _, failure = check_embeddings(ref, got, PLAN_MIN_COSINE)
    assert failure is not None and "1/4 rows are all zeros" in failure


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_gate_refuses_non_finite_output(bad: float) -> None:
    ref = _unit_rows(4, 16)
    got = ref.copy()
    got[1, 3] = bad
    _, failure = check_embeddings(ref, got, PLAN_MIN_COSINE)
    assert failure is not None and "NaN or Inf" in failure


def test_gate_refuses_a_wrong_row_and_a_wrong_shape() -> None:
    ref = _unit_rows(4, 16)
    got = ref.copy()
    got[0] = _unit_rows(1, 16, seed=7)[0]
    cosine, failure = check_embeddings(ref, got, PLAN_MIN_COSINE)
    assert failure is not None and cosine < PLAN_MIN_COSINE
    assert check_embeddings(ref, ref[:3], PLAN_MIN_COSINE)[1] is not None


# --- the FP16 graph, executed in ONNX Runtime on the CPU ---------------------------------

FFN_OUT_SCALE = 3e6  # pushes the residual stream of the tiny T5 to ~1e7, far past FP16


@pytest.fixture(scope="module")
def hot_t5_onnx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny T5 whose FFN output weights are scaled up: T5's FP16 failure, in miniature."""
    from safetensors.torch import load_file, save_file

    from services.encoder.build.export import export_onnx

    root = build_tiny_t5(tmp_path_factory.mktemp("hot") / "hot-t5", seed=1)
    state = load_file(str(root / "model.safetensors"))
    for name in state:
        if "DenseReluDense.wo" in name:
            state[name] = state[name] * FFN_OUT_SCALE
    save_file(state, str(root / "model.safetensors"), metadata={"format": "pt"})
    out = root.parent / "onnx" / "model.onnx"
    export_onnx(root, out)
    return out


def _ort_run(model: onnx.ModelProto, extra_outputs: list[str]) -> list[np.ndarray]:
    import onnxruntime as ort

    model = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v for v in model.graph.value_info}
    model.graph.output.extend(types[name] for name in extra_outputs)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # node by node
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    ids = np.random.default_rng(0).integers(3, 500, size=(4, 40)).astype(np.int64)
    ids[3, 25:] = 0
    mask = (ids != 0).astype(np.int64)
    return list(session.run(None, {"input_ids": ids, "attention_mask": mask}))


RESIDUAL = "/backbone/encoder/block.0/layer.1/Add_output_0"  # after the first scaled `wo`


def test_fp16_cast_without_the_block_list_overflows(hot_t5_onnx: Path) -> None:
    model = onnx.load(str(hot_t5_onnx))
    (reference,) = _ort_run(model, [])
    naive = fp16_graph(model, ())
    got, residual = _ort_run(naive, [RESIDUAL])
    assert residual.dtype == np.float16
    assert not np.isfinite(residual).all()  # overflow in the residual stream
    _, failure = check_embeddings(reference, got, PLAN_MIN_COSINE)
    assert failure is not None  # and the gate refuses what comes out


def test_fp16_cast_with_the_block_list_stays_finite_and_within_parity(hot_t5_onnx: Path) -> None:
    model = onnx.load(str(hot_t5_onnx))
    (reference,) = _ort_run(model, [])
    assert np.isfinite(reference).all()
    cast = fp16_graph(model, select_fp32_nodes(model).all)
    types = {n.op_type for n in cast.graph.node}
    assert "Cast" in types
    fp16_inits = sum(i.data_type == onnx.TensorProto.FLOAT16 for i in cast.graph.initializer)
    assert fp16_inits > 0  # the attention and FFN input weights really are FP16
    got, residual = _ort_run(cast, [RESIDUAL])
    assert residual.dtype == np.float32 and np.isfinite(residual).all()
    assert np.abs(residual).max() > 65504  # the value that FP16 could not hold
    cosine, failure = check_embeddings(reference, got, PLAN_MIN_COSINE)
    assert failure is None and cosine >= PLAN_MIN_COSINE, failure


def test_fp16_cast_sets_weights_aside_for_shape_inference(
    hot_t5_onnx: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GTR xl/xxl exceed protobuf's 2 GB: shape inference runs without the weights' bytes.
    import services.encoder.build.onnx_fp16 as graph_module

    monkeypatch.setattr(graph_module, "_SET_ASIDE", 1024)  # the tiny T5's weights count as big here
    model = onnx.load(str(hot_t5_onnx))
    before = {i.name: i.raw_data for i in model.graph.initializer}
    assert sum(len(b) > 1024 for b in before.values()) > 5
    (reference,) = _ort_run(model, [])
    cast = fp16_graph(model, select_fp32_nodes(model).all)
    assert {i.name: i.raw_data for i in model.graph.initializer} == before  # input untouched
    (got,) = _ort_run(cast, [])
    assert check_embeddings(reference, got, PLAN_MIN_COSINE)[1] is None


def test_fp16_cast_of_the_plain_tiny_t5_keeps_parity(t5_onnx: onnx.ModelProto) -> None:
    (reference,) = _ort_run(t5_onnx, [])
    (got,) = _ort_run(fp16_graph(t5_onnx, select_fp32_nodes(t5_onnx).all), [])
    assert check_embeddings(reference, got, PLAN_MIN_COSINE)[1] is None


# --- the engine inspector, the probe, the plan's metadata ------------------------------


def test_inspector_reports_kept_nodes_that_run_in_fp16() -> None:
    keep = frozenset({"/a/Add", "/a/layer_norm/Pow"})
    info = {
        "Layers": [
            {
                "Name": "L0",
                "Metadata": "[ONNX Layer: /a/Add]",
                "Outputs": [{"Format/Datatype": "Row major linear FP16 format"}],
            },
            {
                "Name": "L1",
                "Metadata": "[ONNX Layer: /a/layer_norm/Pow]",
                "Outputs": [{"Format/Datatype": "Row major linear FP32"}],
            },
            {
                "Name": "L2",
                "Metadata": "[ONNX Layer: /a/Add]\x1f[ONNX Layer: /a/q/MatMul]",
                "Outputs": [{"Format/Datatype": "Row major linear FP16 format"}],
            },
            {"Name": "L3", "Outputs": [{"Format/Datatype": "Row major linear FP16 format"}]},
        ]
    }
    assert fp16_layers_of_kept_nodes(info, keep) == ["L0"]
    assert layers_with_onnx_names(info) == 3


def test_probe_covers_the_maximum_shape() -> None:
    ids = np.array([[5, 6, 1, 0], [7, 8, 9, 1]], dtype=np.int64)
    mask = (ids != 0).astype(np.int64)
    big_ids, big_mask = probe_tokens(ids, mask, (5, 6), pad_id=0)
    assert big_ids.shape == big_mask.shape == (5, 6)
    assert (big_ids[2, :4] == ids[0]).all() and (big_mask[:, 4:] == 0).all()
    cut_ids, _ = probe_tokens(ids, mask, (2, 3), pad_id=0)
    assert cut_ids.tolist() == [[5, 6, 1], [7, 8, 9]]


def test_plan_metadata_round_trips_and_refuses_another_tensorrt(tmp_path: Path) -> None:
    plan = tmp_path / "model.plan"
    meta = PlanMeta("10.7.0.23", "fp16", (1, 1), (8, 128), (32, 256), 0.9995, 120)
    meta.write(plan)
    assert PlanMeta.read(plan) == meta
    meta.check_tensorrt("10.7.0.post1", "Triton 24.12")  # same release: fine
    with pytest.raises(PlanVersionMismatch, match=r"built with TensorRT 10\.7\.0\.23.*11\.4"):
        meta.check_tensorrt("11.4.0.106", "this machine")


def test_plan_without_metadata_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FailedPrecondition, match="build-plan"):
        PlanMeta.read(tmp_path / "model.plan")


def test_the_refusal_names_flags_that_build_plan_has() -> None:
    import argparse
    import re

    from services.cli.encoder_commands import add_cli

    def sub(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
        (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        return action._name_parser_map[name]

    root = argparse.ArgumentParser()
    add_cli(root.add_subparsers())
    options = set(sub(sub(root, "encoder"), "build-plan")._option_string_actions)
    named = set(re.findall(r"--[a-z0-9-]+", MORE_FP32_HINT))
    assert named and named <= options
