"""ONNX export: graph contract, parity with PyTorch, and a parity check that can fail."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from services.encoder.build.export import (
    PROBE_TEXTS,
    EncoderMeta,
    check_parity,
    onnx_session,
    quantize_int8,
    row_cosines,
)
from services.encoder.model import default_model_dir
from services.encoder.runtime.onnx_embedder import OnnxEmbedder
from tests.encoder_fixtures import (
    SAMPLE_DOCUMENTS,
    SAMPLE_QUERIES,
    encoder_base,
    ensure_onnx,
    ensure_tiny_t5,
    mixed_lengths,
    torch_embedder,
)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return encoder_base(tmp_path_factory)


@pytest.fixture(scope="module", params=["minilm", "tiny-t5"])
def exported(request: pytest.FixtureRequest, base: Path) -> tuple[Path, Path]:
    model_dir = default_model_dir() if request.param == "minilm" else ensure_tiny_t5(base)
    return model_dir, ensure_onnx(model_dir, base)


def test_graph_contract(exported: tuple[Path, Path]) -> None:
    _, onnx_path = exported
    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    inputs = {i.name: i.type.tensor_type for i in graph.input}
    assert set(inputs) == {"input_ids", "attention_mask"}
    for tensor in inputs.values():
        assert tensor.elem_type == onnx.TensorProto.INT64
        dims = [d.dim_param for d in tensor.shape.dim]
        assert dims == ["batch", "seq"]  # dynamic batch and sequence
    (output,) = graph.output
    assert output.name == "embedding"
    assert output.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert output.type.tensor_type.shape.dim[0].dim_param == "batch"


def test_parity_with_pytorch(exported: tuple[Path, Path]) -> None:
    model_dir, onnx_path = exported
    report = check_parity(model_dir, onnx_path)
    assert report.passed, report.summary()
    assert report.min_cosine >= 0.9999 and len(report.cosines) >= 4


def test_onnx_embedder_equals_torch_on_queries_and_documents(exported: tuple[Path, Path]) -> None:
    model_dir, onnx_path = exported
    ours = OnnxEmbedder(onnx_path, threads=2)
    reference = torch_embedder(model_dir)
    assert (ours.dim, ours.model_name) == (reference.dim, reference.model_name)
    for texts, kind in ((SAMPLE_QUERIES, "query"), (SAMPLE_DOCUMENTS, "document")):
        got, got_trunc = ours.embed(texts, kind)  # type: ignore[arg-type]
        want, want_trunc = reference.embed(texts, kind)  # type: ignore[arg-type]
        assert got_trunc == want_trunc
        assert min(row_cosines(got, want)) >= 0.9999


@pytest.mark.parametrize("threads", [1, 2])
def test_onnx_embedder_runs_rows_by_length_and_answers_in_order(
    exported: tuple[Path, Path], threads: int
) -> None:
    """A batch of interleaved short and long documents runs in several pieces of rows of
    about one length; every row's vector is the one it gets embedded alone, in its place."""
    _, onnx_path = exported
    ours = OnnxEmbedder(onnx_path, threads=threads)
    texts = mixed_lengths()
    batch = ours.tokenize(texts, "document")
    pieces = batch.pieces(threads)
    assert len(pieces) > 2 and any(len(p) > 1 for p in pieces)
    got, truncated = ours.embed(texts, "document")
    alone = np.concatenate([ours.embed([t], "document")[0] for t in texts])
    assert min(row_cosines(got, alone)) >= 0.99999
    assert truncated == [ours.embed([t], "document")[1][0] for t in texts]


def test_sidecar_files_describe_the_export(exported: tuple[Path, Path]) -> None:
    model_dir, onnx_path = exported
    meta = EncoderMeta.read(onnx_path.parent)
    assert meta.dim == torch_embedder(model_dir).dim
    assert set(meta.max_lens) == {"query", "document"}
    assert (onnx_path.parent / "tokenizer.json").exists()


def test_parity_check_catches_a_broken_export(base: Path, tmp_path: Path) -> None:
    """Perturb one weight matrix: the check must fail, or it proves nothing."""
    model_dir = ensure_tiny_t5(base)
    src = ensure_onnx(model_dir, base)
    model = onnx.load(str(src))
    target = next(i for i in model.graph.initializer if "MatMul" in i.name)
    weights = numpy_helper.to_array(target)
    noise = np.random.default_rng(0).normal(0, 1.0, weights.shape).astype(weights.dtype)
    target.CopyFrom(numpy_helper.from_array(weights + noise, target.name))
    broken = tmp_path / "model.onnx"
    onnx.save(model, str(broken))
    for sidecar in ("tokenizer.json", "encoder.json"):
        (tmp_path / sidecar).write_text((src.parent / sidecar).read_text())
    report = check_parity(model_dir, broken)
    assert not report.passed and "FAILED" in report.summary()


@pytest.mark.parametrize("bad", ["nan", "zero"])
def test_parity_refuses_nan_and_zero_rows_past_the_first(
    bad: str, base: Path, tmp_path: Path
) -> None:
    """Issue #25 item 9: an export whose second row is NaN (or all zeros) while the others
    are exact must fail; Python's ``min`` over the cosines skipped a NaN not in first place."""
    model_dir = ensure_tiny_t5(base)
    src = ensure_onnx(model_dir, base)
    lengths = torch_embedder(model_dir).tokenize(PROBE_TEXTS, "document").attention_mask.sum(1)
    assert lengths[1] < np.delete(lengths, 1).min()  # "x": the shortest, not the first row
    model = onnx.load(str(src))
    graph = model.graph
    producer = next(n for n in graph.node if "embedding" in n.output)
    producer.output[list(producer.output).index("embedding")] = "embedding_raw"
    # embedding * f(tokens - (len(row 1) + 0.5)): f = sqrt gives NaN, relu 0, on row 1 only
    graph.initializer.extend(
        [
            numpy_helper.from_array(np.array([1], dtype=np.int64), "gate_axes"),
            numpy_helper.from_array(np.array(lengths[1] + 0.5, dtype=np.float32), "gate_cut"),
        ]
    )
    graph.node.extend(
        [
            helper.make_node("Cast", ["attention_mask"], ["gate_mask"], to=onnx.TensorProto.FLOAT),
            helper.make_node("ReduceSum", ["gate_mask", "gate_axes"], ["gate_len"], keepdims=1),
            helper.make_node("Sub", ["gate_len", "gate_cut"], ["gate_d"]),
            helper.make_node("Sqrt" if bad == "nan" else "Relu", ["gate_d"], ["gate_f"]),
            helper.make_node("Mul", ["embedding_raw", "gate_f"], ["embedding"]),
        ]
    )
    broken = tmp_path / "model.onnx"
    onnx.save(model, str(broken))
    for sidecar in ("tokenizer.json", "encoder.json"):
        (tmp_path / sidecar).write_text((src.parent / sidecar).read_text())
    report = check_parity(model_dir, broken)
    cosines = np.asarray(report.cosines)
    assert np.isnan(cosines[1]) and (np.delete(cosines, 1) >= 0.9999).all()  # only row 1
    assert not report.passed, report.summary()
    assert "FAILED" in report.summary() and np.isnan(report.min_cosine)
    reason = "NaN or Inf" if bad == "nan" else "all zeros"
    assert report.problem is not None and reason in report.problem


@pytest.mark.slow
def test_int8_quantisation_stays_close(base: Path, tmp_path: Path) -> None:
    src = ensure_onnx(default_model_dir(), base)
    q_path = quantize_int8(src, tmp_path / "model.int8.onnx")
    embedder = torch_embedder(default_model_dir())
    batch = embedder.tokenize(SAMPLE_DOCUMENTS, "document")
    feeds = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
    (got,) = onnx_session(q_path).run(["embedding"], feeds)  # type: ignore[attr-defined]
    assert min(row_cosines(got, embedder.run(batch))) >= 0.97
