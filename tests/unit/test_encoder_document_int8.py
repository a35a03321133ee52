"""int8 documents (issues #33/#34): the int8 query graph serving documents too, its
gates, one document per graph run, and ``up``'s choice of export.

The default model (all-MiniLM-L6-v2) is exported as a user's machine or CI would, with
no BEIR data: its gates' quality results come from the committed record of these graphs.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from services.common.errors import FailedPrecondition, InvalidArgument
from services.encoder.build import document_int8, int8_record
from services.encoder.build.document_int8 import DocumentsRefused
from services.encoder.build.export import INT8_ONNX, EncoderMeta, onnx_session, row_cosines
from services.encoder.build.int8_recheck import Int8Check, recheck_int8
from services.encoder.build.query_int8 import (
    GATE_FILE,
    INT8_QUERY_ONNX,
    add_int8_query_tower,
    quantize_query_graph,
)
from services.encoder.build.repository import generate_repository
from services.encoder.model import default_model_dir
from services.encoder.runtime.onnx_embedder import OnnxEmbedder
from services.stack import triton_component
from services.stack.config import StackConfig
from tests.encoder_fixtures import SAMPLE_DOCUMENTS, encoder_base, ensure_onnx
from tests.unit.test_encoder_query_int8 import _copy_export, _negated, _triton_model

pytestmark = pytest.mark.slow  # the MiniLM export and its quantisation: ~30 s for the module


@pytest.fixture(scope="module")
def fp32_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_onnx(default_model_dir(), encoder_base(tmp_path_factory))


@pytest.fixture(scope="module")
def int8_docs(fp32_export: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's export with int8 queries and documents, made without data."""
    onnx_path = _copy_export(fp32_export, tmp_path_factory.mktemp("int8-docs") / "export")
    with pytest.MonkeyPatch.context() as env:
        env.delenv("GTR_DATA_DIR", raising=False)
        add_int8_query_tower(onnx_path, None, documents=True)
    return onnx_path


def test_one_int8_graph_serves_both_kinds_and_both_gates_are_recorded(int8_docs: Path) -> None:
    meta = EncoderMeta.read(int8_docs.parent)
    assert (meta.query_precision, meta.document_precision) == ("int8", "int8")
    assert meta.towers == {"query": INT8_ONNX, "document": INT8_ONNX}
    assert meta.row_by_row() == {"query", "document"}
    assert not (int8_docs.parent / INT8_QUERY_ONNX).exists()
    gates = json.loads((int8_docs.parent / GATE_FILE).read_text())
    documents = gates["documents"]
    assert documents["quality"]["recorded"] == int8_record.RECORD_FILE.name
    assert documents["quality"]["passed"] and documents["quality"]["drop"] <= 0.003
    assert documents["parity_min_cosine"] >= document_int8.DOCUMENT_PARITY_MIN_COSINE
    assert len(documents["parity_cosines"]) == len(document_int8.DOCUMENT_PARITY_TEXTS)


def test_documents_run_one_per_graph_run_so_companions_change_nothing(
    int8_docs: Path, fp32_export: Path
) -> None:
    embedder = OnnxEmbedder(int8_docs, threads=1)
    int8 = onnx_session(int8_docs.parent / INT8_ONNX, threads=1)
    together, _ = embedder.embed(SAMPLE_DOCUMENTS, "document")
    for text, vector in zip(SAMPLE_DOCUMENTS, together, strict=True):
        one = embedder.tokenize([text], "document")
        feeds = {"input_ids": one.input_ids, "attention_mask": one.attention_mask}
        alone = int8.run(["embedding"], feeds)[0][0]  # type: ignore[attr-defined]
        np.testing.assert_array_equal(vector, alone)
    # batched, the same int8 graph gives other vectors: why it runs row by row
    batch = embedder.tokenize(SAMPLE_DOCUMENTS, "document")
    feeds = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
    batched = int8.run(["embedding"], feeds)[0]  # type: ignore[attr-defined]
    assert not np.array_equal(batched, together)
    fp32, _ = OnnxEmbedder(fp32_export, threads=1).embed(SAMPLE_DOCUMENTS, "document")
    cosines = row_cosines(fp32, together)
    assert min(cosines) >= document_int8.DOCUMENT_PARITY_MIN_COSINE and max(cosines) < 1 - 1e-6


def test_triton_model_runs_documents_row_by_row_as_in_process(
    int8_docs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = generate_repository(int8_docs, tmp_path / "repo")
    version = repo.root / "embed" / "1"
    graph = (int8_docs.parent / INT8_ONNX).read_bytes()
    assert (version / "model.onnx").read_bytes() == graph
    assert (version / "document.onnx").read_bytes() == graph
    model = _triton_model(version, repo.config_path("embed"), monkeypatch)
    try:
        assert model.row_by_row == {"query", "document"}
        vectors, _ = model._embed(
            list(SAMPLE_DOCUMENTS), ["document"] * len(SAMPLE_DOCUMENTS), lambda: False
        )
    finally:
        model.finalize()
    want, _ = OnnxEmbedder(int8_docs, threads=1).embed(SAMPLE_DOCUMENTS, "document")
    np.testing.assert_allclose(vectors, want, atol=1e-6)


def test_without_a_recorded_document_result_or_data_int8_documents_are_refused(
    fp32_export: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record of these graphs that holds the query result only (as before documents
    were measured) answers the query gate, not the document gate."""
    record = json.loads(int8_record.RECORD_FILE.read_text())
    for row in record["records"]:
        row.pop("document_quality", None)
        row.pop("document_parity_cosines", None)
    older = tmp_path / "record.json"
    older.write_text(json.dumps(record))
    monkeypatch.setattr(int8_record, "RECORD_FILE", older)
    monkeypatch.delenv("GTR_DATA_DIR", raising=False)
    onnx_path = _copy_export(fp32_export, tmp_path / "export")
    before = sorted(p.name for p in onnx_path.parent.iterdir())
    with pytest.raises(DocumentsRefused, match="their quality is not measured") as info:
        add_int8_query_tower(onnx_path, None, documents=True)
    assert "has no result for int8 documents" in str(info.value)
    assert "--document-precision fp32" in str(info.value)
    assert sorted(p.name for p in onnx_path.parent.iterdir()) == before  # nothing written


def test_a_failed_document_parity_gate_refuses_and_writes_nothing(
    fp32_export: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(document_int8, "DOCUMENT_PARITY_MIN_COSINE", 1.01)  # none can pass
    onnx_path = _copy_export(fp32_export, tmp_path / "export")
    before = {p.name: p.read_bytes() for p in onnx_path.parent.iterdir()}
    with pytest.raises(DocumentsRefused, match="min cosine vs the FP32 graph"):
        add_int8_query_tower(onnx_path, None, documents=True)
    assert {p.name: p.read_bytes() for p in onnx_path.parent.iterdir()} == before


@pytest.fixture
def stack_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """``up``'s default model on a machine without BEIR data."""
    monkeypatch.delenv("GTR_DATA_DIR", raising=False)


@pytest.mark.usefixtures("stack_model")
def test_up_serves_int8_documents_when_asked_and_fp32_ones_by_default(tmp_path: Path) -> None:
    for asked in ("auto", "int8"):
        cfg = StackConfig(run_dir=tmp_path / asked, document_precision=asked)
        said: list[str] = []
        onnx_path = triton_component.onnx_export(cfg, said.append)
        assert onnx_path.parent == cfg.run_dir / "export-int8-docs"
        assert EncoderMeta.read(onnx_path.parent).document_precision == "int8"
        assert any("int8 queries and documents (gates:" in s for s in said), said
    default = StackConfig(run_dir=tmp_path / "default")
    assert triton_component.onnx_export(default, lambda _: None).parent.name == "export-int8"
    # a run dir whose first `up` stored int8 documents keeps them when the flag is left out
    said = []
    again = triton_component.onnx_export(StackConfig(run_dir=tmp_path / "int8"), said.append)
    assert again.parent.name == "export-int8-docs"
    assert not any("exporting" in s for s in said), said


@pytest.mark.usefixtures("stack_model")
def test_auto_falls_back_to_fp32_documents_when_their_gate_refuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(document_int8, "DOCUMENT_PARITY_MIN_COSINE", 1.01)
    cfg = StackConfig(run_dir=tmp_path / "run", document_precision="auto")
    said: list[str] = []
    onnx_path = triton_component.onnx_export(cfg, said.append)
    assert onnx_path.parent == cfg.run_dir / "export-int8"  # int8 queries still
    assert not (cfg.run_dir / "export-int8-docs").exists()
    refused = [s for s in said if s.startswith("encoder    FP32 documents:")]
    assert len(refused) == 1 and "int8 documents are refused" in refused[0], said

    explicit = StackConfig(run_dir=tmp_path / "other", document_precision="int8")
    with pytest.raises(DocumentsRefused):  # asked for: refused, not downgraded
        triton_component.onnx_export(explicit, lambda _: None)
    assert not explicit.run_dir.exists() or not any(explicit.run_dir.iterdir())


@pytest.mark.usefixtures("stack_model")
def test_a_run_dir_with_fp32_documents_keeps_them(tmp_path: Path, fp32_export: Path) -> None:
    """Its stored vectors are FP32's: ``auto`` does not move it to int8 documents."""
    cfg = StackConfig(run_dir=tmp_path / "run", document_precision="auto")
    shutil.copytree(fp32_export.parent, cfg.run_dir / "export-int8")
    add_int8_query_tower(cfg.run_dir / "export-int8" / "model.onnx", None)  # queries only
    said: list[str] = []
    onnx_path = triton_component.onnx_export(cfg, said.append)
    assert onnx_path.parent == cfg.run_dir / "export-int8"
    assert not (cfg.run_dir / "export-int8-docs").exists()
    assert any("is this run dir's export" in s for s in said), said
    assert not any("exporting" in s for s in said), said


def test_int8_documents_need_int8_queries(tmp_path: Path) -> None:
    from services.cli.main import build_parser, main
    from services.cli.stack_commands import stack_config

    with pytest.raises(InvalidArgument, match="int8 documents come with int8 queries"):
        triton_component.onnx_export(
            StackConfig(run_dir=tmp_path, query_precision="fp32", document_precision="int8"),
            lambda _: None,
        )
    up = ["up", "--run-dir", str(tmp_path / "run")]
    assert stack_config(build_parser().parse_args(up)).document_precision is None
    args = build_parser().parse_args([*up, "--document-precision", "int8"])
    assert stack_config(args).document_precision == "int8"
    with pytest.raises(SystemExit, match="comes with int8 queries"):
        main([*up, "--document-precision", "int8", "--query-precision", "fp32"])
    with pytest.raises(SystemExit, match="--encoder inprocess runs the PyTorch model"):
        main([*up, "--document-precision", "int8", "--encoder", "inprocess"])
    assert not (tmp_path / "run").exists()
    out = tmp_path / "x" / "model.onnx"
    with pytest.raises(SystemExit, match="comes with --query-precision int8"):
        main(["encoder", "export", "--document-precision", "int8", "--out", str(out)])
    assert not out.parent.exists()


def test_parity_with_pytorch_and_publish_check_the_fp32_graph(
    int8_docs: Path, tmp_path: Path
) -> None:
    """``encoder export``'s parity check and ``encoder publish`` of the export folder (the
    rollout's ``--encoder DIR``) compare PyTorch with the FP32 graph at 0.9999; the int8
    graph serving both kinds has its own gates against that graph."""
    from services.encoder.build.export import check_parity
    from services.encoder.serve import publish

    report = check_parity(default_model_dir(), int8_docs)
    assert report.passed, report.summary()
    export = publish._export(int8_docs.parent, tmp_path)  # re-checks against the checkpoint
    assert export.meta.document_precision == "int8"


# --- the int8 graphs checked again at publish (int8_recheck) ----------------------------


def _copy_folder(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst / "model.onnx"


def _ungated(fp32_export: Path, dst: Path) -> Path:
    """An export naming int8 towers with no gate record: a hand edit, or what the rollout
    bench makes when the perturbed encoder's quality gate refuses it."""
    onnx_path = _copy_export(fp32_export, dst)
    quantize_query_graph(onnx_path, onnx_path.parent / INT8_ONNX)
    meta = EncoderMeta.read(onnx_path.parent)
    towers = {"query": INT8_ONNX, "document": INT8_ONNX}
    replace(meta, towers=towers, query_precision="int8", document_precision="int8").write(
        onnx_path.parent
    )
    return onnx_path


def _recheck(onnx_path: Path, unmeasured: bool = False) -> Int8Check | None:
    return recheck_int8(onnx_path, EncoderMeta.read(onnx_path.parent), unmeasured=unmeasured)


@pytest.fixture
def no_committed_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As for any model but the default one: no committed quality result to fall back on."""
    monkeypatch.setattr(int8_record, "RECORD_FILE", tmp_path / "no-record.json")


def test_publish_takes_int8_graphs_on_their_own_gate_record(
    int8_docs: Path, no_committed_record: None
) -> None:
    gates = json.loads((int8_docs.parent / GATE_FILE).read_text())
    assert gates["graphs"] == int8_record.gate_graphs(int8_docs, int8_docs.parent / INT8_ONNX)
    checked = _recheck(int8_docs)
    assert checked is not None and checked.measured
    assert f"quality from the export's {GATE_FILE}" in checked.note
    assert "query (model.int8.onnx) and document (model.int8.onnx)" in checked.note


def test_publish_refuses_an_int8_graph_changed_after_its_gates(
    int8_docs: Path, fp32_export: Path, tmp_path: Path
) -> None:
    onnx_path = _copy_folder(int8_docs.parent, tmp_path / "export")
    _negated(fp32_export, onnx_path.parent / INT8_ONNX)  # passes for the gated graph no more
    with pytest.raises(FailedPrecondition, match="refused, int8 query graph: min cosine"):
        _recheck(onnx_path, unmeasured=True)  # parity is checked, asked or not


def test_a_gate_record_of_other_graphs_does_not_vouch_for_these(
    int8_docs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    onnx_path = _copy_folder(int8_docs.parent, tmp_path / "export")
    gates = json.loads((onnx_path.parent / GATE_FILE).read_text())
    gates["graphs"]["int8_sha256"] = "0" * 64
    (onnx_path.parent / GATE_FILE).write_text(json.dumps(gates))
    # the default model's graphs: the committed record holds for them
    checked = _recheck(onnx_path)
    assert checked is not None and checked.measured
    assert "quality from the committed record" in checked.note
    monkeypatch.setattr(int8_record, "RECORD_FILE", tmp_path / "no-record.json")
    with pytest.raises(FailedPrecondition, match="is of other graphs") as info:
        _recheck(onnx_path)
    assert "--int8-unmeasured" in str(info.value)


def test_int8_graphs_nobody_gated_are_published_only_when_asked(
    fp32_export: Path, tmp_path: Path, no_committed_record: None
) -> None:
    from services.encoder.serve.publish import publish_version

    repo = generate_repository(fp32_export, tmp_path / "repo").root
    ungated = _ungated(fp32_export, tmp_path / "ungated")
    files = sorted(p.relative_to(repo) for p in repo.rglob("*"))
    with pytest.raises(FailedPrecondition, match="no quality result holds for them") as info:
        publish_version(repo, ungated.parent)
    assert f"has no gate record ({GATE_FILE})" in str(info.value)
    assert sorted(p.relative_to(repo) for p in repo.rglob("*")) == files  # nothing published
    checked = _recheck(ungated, unmeasured=True)
    assert checked is not None and not checked.measured and "NOT measured" in checked.note
    assert publish_version(repo, ungated.parent, int8_unmeasured=True).version == 2
    assert _recheck(fp32_export) is None  # an FP32 export has nothing to check
