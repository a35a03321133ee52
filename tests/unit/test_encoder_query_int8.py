"""The int8 query tower (issue #34): quantized query graph, FP32 document graph, the
gates that refuse a bad one, and the graph each kind is run through."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from google.protobuf import json_format
from onnx import helper

from services.common.errors import FailedPrecondition
from services.encoder.build import int8_record, query_int8
from services.encoder.build.export import EncoderMeta, onnx_session, row_cosines
from services.encoder.build.query_int8 import (
    GATE_FILE,
    INT8_QUERY_ONNX,
    QUALITY_MAX_DROP,
    add_int8_query_tower,
    check_int8_parity,
    gate_int8_query,
)
from services.encoder.build.repository import generate_repository, read_config
from services.encoder.model import default_model_dir
from services.encoder.runtime.onnx_embedder import OnnxEmbedder
from tests.encoder_fixtures import (
    SAMPLE_DOCUMENTS,
    SAMPLE_QUERIES,
    encoder_base,
    ensure_onnx,
    write_beir,
)

QUANTIZED_OPS = {"MatMulInteger", "DynamicQuantizeLinear", "QLinearMatMul"}


@pytest.fixture(scope="module")
def fp32_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's FP32 export of all-MiniLM-L6-v2 (shared with the other encoder tests)."""
    return ensure_onnx(default_model_dir(), encoder_base(tmp_path_factory))


def _copy_export(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for name in ("model.onnx", "tokenizer.json", "encoder.json"):
        shutil.copy2(src.parent / name, dst / name)
    return dst / "model.onnx"


@pytest.fixture(scope="module")
def int8_export(fp32_export: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's int8 export as made where no BEIR data is (a user's machine,
    CI): its quality gate answered by the committed record of these graphs."""
    onnx_path = _copy_export(fp32_export, tmp_path_factory.mktemp("int8") / "export")
    with pytest.MonkeyPatch.context() as env:
        env.delenv("GTR_DATA_DIR", raising=False)
        add_int8_query_tower(onnx_path, None)
    return onnx_path


def _ops(path: Path) -> set[str]:
    return {node.op_type for node in onnx.load(str(path)).graph.node}


@pytest.mark.slow  # the MiniLM export and its quantisation: ~20 s for the module
def test_query_graph_is_int8_and_document_graph_is_the_fp32_export(
    int8_export: Path, fp32_export: Path
) -> None:
    meta = EncoderMeta.read(int8_export.parent)
    assert meta.query_precision == "int8"
    assert meta.towers == {"query": INT8_QUERY_ONNX, "document": "model.onnx"}
    files = meta.onnx_files(int8_export)
    assert _ops(files["query"]) & QUANTIZED_OPS
    assert not _ops(files["document"]) & QUANTIZED_OPS
    assert files["document"].read_bytes() == fp32_export.read_bytes()
    record = json.loads((int8_export.parent / GATE_FILE).read_text())
    assert record["parity_min_cosine"] >= record["parity_threshold"]
    assert record["quality"]["passed"] and record["quality"]["queries"] > 0


@pytest.mark.slow  # the MiniLM export and its quantisation: ~20 s for the module
def test_without_data_the_default_model_takes_the_recorded_quality_result(
    int8_export: Path,
) -> None:
    """The pinned torch/onnx/onnxruntime make the graphs the record was measured on (if
    this fails after an upgrade: `python -m bench.query_int8 --record` with the data)."""
    gates = json.loads((int8_export.parent / GATE_FILE).read_text())
    int8 = int8_export.parent / INT8_QUERY_ONNX
    name = "all-MiniLM-L6-v2"
    recorded, why = int8_record.find_record(name, int8_export, int8, gates["parity_cosines"])
    assert recorded is not None, why
    assert gates["quality"]["recorded"] == int8_record.RECORD_FILE.name
    assert gates["quality"]["int8_ndcg_at_10"] == recorded.quality["int8_ndcg_at_10"]
    assert recorded.quality["passed"] and recorded.quality["drop"] <= QUALITY_MAX_DROP
    assert recorded.int8_sha256 == int8_record.graph_sha256(int8_export.parent / INT8_QUERY_ONNX)
    here = np.asarray(gates["parity_cosines"])
    assert np.abs(here - np.asarray(recorded.parity_cosines)).max() < 1e-5


@pytest.mark.slow  # the MiniLM export and its quantisation: ~20 s for the module
def test_given_data_the_quality_gate_is_measured_not_recorded(
    int8_export: Path, tmp_path: Path
) -> None:
    beir = write_beir(tmp_path / "beir", queries=12, docs=40)
    gates = gate_int8_query(int8_export, int8_export.parent / INT8_QUERY_ONNX, beir)
    assert "recorded" not in gates.quality and gates.quality["data"] == str(beir)
    assert gates.quality["passed"] and gates.quality["queries"] > 0


@pytest.mark.slow  # the MiniLM export and its quantisation: ~20 s for the module
def test_a_record_does_not_hold_for_other_graphs_or_other_kernels(int8_export: Path) -> None:
    int8 = int8_export.parent / INT8_QUERY_ONNX
    name = "all-MiniLM-L6-v2"
    here = json.loads((int8_export.parent / GATE_FILE).read_text())["parity_cosines"]
    recorded, why = int8_record.find_record(name, int8_export, int8, here)
    assert recorded is not None, why
    cosines = list(recorded.parity_cosines)
    assert int8_record.find_record(name, int8_export, int8, cosines)[0] == recorded
    shifted = [cosines[0] - 2 * int8_record.COSINE_TOLERANCE, *cosines[1:]]
    record, why = int8_record.find_record(name, int8_export, int8, shifted)
    assert record is None and "computes otherwise here" in why
    record, why = int8_record.find_record(name, int8, int8, cosines)  # another FP32 graph
    assert record is None and "not the recorded ones" in why
    record, why = int8_record.find_record("my-model", int8_export, int8, cosines)
    assert record is None and "no quality result is recorded for my-model" in why


def _negated(src: Path, dst: Path) -> Path:
    """``src`` with its output negated: every row's cosine with ``src`` is -1."""
    model = onnx.load(str(src))
    graph = model.graph
    (output,) = graph.output
    graph.node[-1].output[0] = "before_neg"
    for node in graph.node:  # rename every other use of the output name
        node.input[:] = ["before_neg" if i == output.name else i for i in node.input]
    graph.node.append(helper.make_node("Neg", ["before_neg"], [output.name]))
    onnx.save(model, str(dst))
    return dst


@pytest.mark.slow  # the MiniLM export and its quantisation: ~20 s for the module
def test_parity_gate_refuses_a_broken_int8_graph(fp32_export: Path, tmp_path: Path) -> None:
    broken = _negated(fp32_export, tmp_path / "broken.onnx")
    cosines, problem = check_int8_parity(fp32_export, broken)
    assert problem is not None and "min cosine" in problem
    assert float(cosines.max()) < 0


@pytest.mark.slow  # the MiniLM export and its quantisation: ~20 s for the module
def test_refused_tower_leaves_the_export_as_it_was(
    fp32_export: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    onnx_path = _copy_export(fp32_export, tmp_path / "export")
    before = (onnx_path.parent / "encoder.json").read_text()
    monkeypatch.setattr(query_int8, "quantize_query_graph", _negated)  # a "quantizer" gone wrong
    with pytest.raises(FailedPrecondition, match="int8 query tower is refused"):
        add_int8_query_tower(onnx_path, None)
    assert (onnx_path.parent / "encoder.json").read_text() == before
    assert sorted(p.name for p in onnx_path.parent.iterdir()) == [
        "encoder.json",
        "model.onnx",
        "tokenizer.json",
    ]


@pytest.mark.slow  # the MiniLM export and its quantisation: ~20 s for the module
def test_embedder_runs_queries_int8_row_by_row_and_documents_fp32(int8_export: Path) -> None:
    embedder = OnnxEmbedder(int8_export, threads=1)
    fp32 = onnx_session(int8_export, threads=1)
    int8 = onnx_session(int8_export.parent / INT8_QUERY_ONNX, threads=1)
    docs, _ = embedder.embed(SAMPLE_DOCUMENTS, "document")
    batch = embedder.tokenize(SAMPLE_DOCUMENTS, "document")
    feeds = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
    # the FP32 graph (run in pieces of rows by length: float noise against the whole batch)
    whole = fp32.run(["embedding"], feeds)[0]  # type: ignore[attr-defined]
    np.testing.assert_allclose(docs, whole, atol=1e-6)
    queries, _ = embedder.embed(SAMPLE_QUERIES, "query")
    for text, vector in zip(SAMPLE_QUERIES, queries, strict=True):
        one = embedder.tokenize([text], "query")
        alone = int8.run(  # type: ignore[attr-defined]
            ["embedding"], {"input_ids": one.input_ids, "attention_mask": one.attention_mask}
        )[0][0]
        np.testing.assert_array_equal(vector, alone)  # its companions change nothing
    fp32_queries = fp32.run(  # type: ignore[attr-defined]
        ["embedding"],
        {
            k: getattr(embedder.tokenize(SAMPLE_QUERIES, "query"), k)
            for k in ("input_ids", "attention_mask")
        },
    )[0]
    cosines = row_cosines(fp32_queries, queries)
    assert min(cosines) >= query_int8.INT8_PARITY_MIN_COSINE and max(cosines) < 1 - 1e-6


def _triton_model(version_dir: Path, config_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The repository's ``embed`` model code, loaded as Triton's Python backend would
    (its ``triton_python_backend_utils`` is only needed by ``execute``, not run here)."""
    if "triton_python_backend_utils" not in sys.modules:
        stand_in = types.ModuleType("triton_python_backend_utils")
        monkeypatch.setitem(sys.modules, "triton_python_backend_utils", stand_in)
    spec = importlib.util.spec_from_file_location("embed_int8_model", version_dir / "model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = json_format.MessageToDict(read_config(config_path), preserving_proto_field_name=True)
    model = module.TritonPythonModel()
    model.initialize(
        {
            "model_config": json.dumps(config),
            "model_version": version_dir.name,
            "model_repository": str(version_dir.parent),
        }
    )
    return model


@pytest.mark.slow  # the MiniLM export and its quantisation: ~20 s for the module
def test_triton_model_runs_each_kind_through_its_graph(
    int8_export: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = generate_repository(int8_export, tmp_path / "repo")
    version = repo.root / "embed" / "1"
    assert (version / "model.onnx").read_bytes() == (
        int8_export.parent / INT8_QUERY_ONNX
    ).read_bytes()
    assert (version / "document.onnx").read_bytes() == int8_export.read_bytes()
    model = _triton_model(version, repo.config_path("embed"), monkeypatch)
    texts = [*SAMPLE_QUERIES, *SAMPLE_DOCUMENTS]
    kinds = ["query"] * len(SAMPLE_QUERIES) + ["document"] * len(SAMPLE_DOCUMENTS)
    vectors, _ = model._embed(texts, kinds, lambda: False)
    embedder = OnnxEmbedder(int8_export, threads=1)
    np.testing.assert_allclose(
        vectors[: len(SAMPLE_QUERIES)], embedder.embed(SAMPLE_QUERIES, "query")[0], atol=1e-6
    )
    np.testing.assert_allclose(
        vectors[len(SAMPLE_QUERIES) :],
        embedder.embed(SAMPLE_DOCUMENTS, "document")[0],
        atol=1e-6,
    )
    model.finalize()


def test_up_takes_the_query_precision_and_refuses_it_in_process(tmp_path: Path) -> None:
    from services.cli.main import build_parser, main
    from services.cli.stack_commands import stack_config

    up = ["up", "--run-dir", str(tmp_path)]
    args = build_parser().parse_args([*up, "--query-precision", "int8"])
    assert stack_config(args).query_precision == "int8"
    default = build_parser().parse_args(["up", "--run-dir", str(tmp_path)])
    assert stack_config(default).query_precision == "auto"
    args = build_parser().parse_args([*up, "--query-precision", "fp32"])
    assert stack_config(args).query_precision == "fp32"
    args = build_parser().parse_args([*up, "--encoder", "inprocess"])  # auto: FP32 there
    assert stack_config(args).encoder == "inprocess"
    with pytest.raises(SystemExit, match="--encoder inprocess runs the PyTorch model"):
        main(
            [
                "up",
                "--run-dir",
                str(tmp_path / "run"),
                "--encoder",
                "inprocess",
                "--query-precision",
                "int8",
            ]
        )
    assert not (tmp_path / "run").exists()
