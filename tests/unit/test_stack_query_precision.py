"""``up``'s query precision (issue #34): "auto" serves the int8 query tower when its gates
pass and FP32 otherwise, saying why; a model whose quality nobody measured gets no int8
queries; a run dir keeps the export its first ``up`` made. (int8 documents:
test_encoder_document_int8.py.)

Run on the tiny GTR-layout T5 standing in for the default model (a model with no
recorded quality result, and no BEIR data here); the default model itself, which has
one, is tested in test_encoder_query_int8.py and through Triton in
tests/integration/test_triton_encoder.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from services.common.errors import FailedPrecondition
from services.encoder import model as encoder_model
from services.encoder.build.export import EncoderMeta
from services.encoder.build.query_int8 import GATE_FILE, INT8_QUERY_ONNX, add_int8_query_tower
from services.stack import triton_component
from services.stack.config import StackConfig
from tests.encoder_fixtures import encoder_base, ensure_onnx, ensure_tiny_t5, write_beir


@pytest.fixture
def tiny_default(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The tiny T5 as ``up``'s default model, on a machine without BEIR data."""
    model_dir = ensure_tiny_t5(encoder_base(tmp_path_factory))
    monkeypatch.setattr(encoder_model, "default_model_dir", lambda: model_dir)
    monkeypatch.delenv("GTR_DATA_DIR", raising=False)
    return model_dir


def test_a_model_without_recorded_quality_or_data_is_refused_int8(
    tiny_default: Path, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    fp32 = ensure_onnx(tiny_default, encoder_base(tmp_path_factory))
    export = tmp_path / "export"
    shutil.copytree(fp32.parent, export)
    before = sorted(p.name for p in export.iterdir())
    with pytest.raises(FailedPrecondition, match="its quality is not measured") as info:
        add_int8_query_tower(export / "model.onnx", None)
    assert "no quality result is recorded for" in str(info.value)
    assert "--quality-data" in str(info.value) and "--query-precision fp32" in str(info.value)
    assert sorted(p.name for p in export.iterdir()) == before  # nothing written
    # with data, the same model's int8 tower is measured (and here passes)
    beir = write_beir(tmp_path / "beir", queries=12, docs=40)
    add_int8_query_tower(export / "model.onnx", beir)
    gates = json.loads((export / GATE_FILE).read_text())
    assert "recorded" not in gates["quality"] and gates["quality"]["passed"]


def test_auto_falls_back_to_fp32_and_says_why(tiny_default: Path, tmp_path: Path) -> None:
    cfg = StackConfig(run_dir=tmp_path / "run")
    assert cfg.query_precision == "auto"
    said: list[str] = []
    onnx_path = triton_component.onnx_export(cfg, said.append)
    assert onnx_path == cfg.run_dir / "export" / "model.onnx"
    assert EncoderMeta.read(onnx_path.parent).query_precision == "fp32"
    for refused_dir in ("export-int8-docs", "export-int8"):  # the refused export left nothing
        assert not (cfg.run_dir / refused_dir).exists()
    refused = [s for s in said if s.startswith("encoder    FP32 queries:")]
    assert len(refused) == 1 and "its quality is not measured" in refused[0], said

    said.clear()  # `up` again: the run dir's export, not another int8 attempt
    assert triton_component.onnx_export(cfg, said.append) == onnx_path
    assert any("is this run dir's export" in s for s in said), said
    assert not any("exporting" in s for s in said), said


def test_explicit_int8_is_refused_not_downgraded(tiny_default: Path, tmp_path: Path) -> None:
    cfg = StackConfig(run_dir=tmp_path / "run", query_precision="int8")
    with pytest.raises(FailedPrecondition, match="int8 query tower is refused"):
        triton_component.onnx_export(cfg, lambda _: None)
    assert not (cfg.run_dir / "export").exists()


def test_auto_keeps_a_run_dirs_int8_export(
    tiny_default: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run dir whose first ``up`` made the int8 export keeps serving it (the gates ran
    then; they are not asked again)."""
    beir = write_beir(tmp_path / "beir", queries=12, docs=40)
    monkeypatch.setenv("GTR_DATA_DIR", str(beir.parent))
    (beir.parent / "scifact").symlink_to(beir)
    first = StackConfig(run_dir=tmp_path / "run", document_precision="fp32")
    said: list[str] = []
    onnx_path = triton_component.onnx_export(first, said.append)
    assert onnx_path == first.run_dir / "export-int8" / "model.onnx"
    meta = EncoderMeta.read(onnx_path.parent)
    assert meta.query_precision == "int8" and meta.towers["query"] == INT8_QUERY_ONNX
    assert meta.document_precision == "fp32"
    assert any("int8 queries, FP32 documents (gates:" in s for s in said), said
    monkeypatch.delenv("GTR_DATA_DIR")
    said.clear()
    cfg = StackConfig(run_dir=first.run_dir)  # auto for both: keeps it
    assert triton_component.onnx_export(cfg, said.append) == onnx_path
    assert not any("exporting" in s for s in said), said
    assert not (cfg.run_dir / "export-int8-docs").exists()
