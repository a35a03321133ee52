"""An export's parity record (``parity.json``): a publish of the same graphs and checkpoint
takes it instead of loading the checkpoint in PyTorch; anything changed is checked again."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx
import pytest

from services.encoder.build import parity_record
from services.encoder.build.export import PARITY_MIN_COSINE, ParityReport, check_parity
from services.encoder.model import default_model_dir
from services.encoder.serve import publish
from tests.encoder_fixtures import encoder_base, ensure_onnx

pytestmark = pytest.mark.slow  # the MiniLM export (shared by the session) and PyTorch checks


@pytest.fixture(scope="module")
def fp32_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_onnx(default_model_dir(), encoder_base(tmp_path_factory))


@pytest.fixture
def export(fp32_export: Path, tmp_path: Path) -> Path:
    """A copy of the export folder whose files a test may change."""
    shutil.copytree(fp32_export.parent, tmp_path / "export")
    (tmp_path / "export" / parity_record.PARITY_FILE).unlink(missing_ok=True)
    return tmp_path / "export" / "model.onnx"


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    return Path(shutil.copytree(default_model_dir(), tmp_path / "checkpoint"))


@pytest.fixture
def torch_checks(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The graphs checked in PyTorch from here on (the real check runs)."""
    seen: list[Path] = []

    def counted(model_dir: Path, onnx_path: Path, **kwargs: Any) -> ParityReport:
        seen.append(Path(onnx_path))
        return check_parity(model_dir, onnx_path, **kwargs)

    monkeypatch.setattr(parity_record, "check_parity", counted)
    return seen


def test_a_passing_check_is_recorded_and_then_taken_for_the_same_bytes(
    export: Path, checkpoint: Path, torch_checks: list[Path]
) -> None:
    scratch, _ = parity_record.checked(checkpoint, export, PARITY_MIN_COSINE, keep=False)
    assert scratch.passed and not (export.parent / parity_record.PARITY_FILE).exists()
    first, from_record = parity_record.checked(checkpoint, export, PARITY_MIN_COSINE)
    assert first.passed and not from_record and torch_checks == [export, export]
    record = json.loads((export.parent / parity_record.PARITY_FILE).read_text())
    assert record["graphs"] == {"model.onnx": parity_record.export_graphs(export)["model.onnx"]}
    again, from_record = parity_record.checked(checkpoint, export, PARITY_MIN_COSINE)
    assert from_record and torch_checks == [export, export]  # not run again
    assert again.cosines == first.cosines and again.passed


def test_publish_of_a_recorded_export_loads_no_checkpoint(
    export: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``encoder publish DIR`` / ``index rollout --encoder DIR`` of an export whose record
    holds: no PyTorch (the check would fail here if it ran)."""
    report = check_parity(default_model_dir(), export)
    assert parity_record.write(default_model_dir(), export, report) is not None

    def refuse(*args: Any, **kwargs: Any) -> ParityReport:
        raise AssertionError("the checkpoint was run in PyTorch again")

    monkeypatch.setattr(parity_record, "check_parity", refuse)
    done = publish._export(export.parent, tmp_path / "work")
    assert done.onnx_path == export


def _graph_rewritten(export: Path, checkpoint: Path) -> None:
    model = onnx.load(str(export))
    model.producer_name = "rewritten"  # the same computation in other bytes
    onnx.save(model, str(export))


def _checkpoint_file_added(export: Path, checkpoint: Path) -> None:
    (checkpoint / "notes.txt").write_text("a file the record did not see\n")


def _checkpoint_weights_changed(export: Path, checkpoint: Path) -> None:
    weights = next(checkpoint.glob("*.safetensors"), None) or next(checkpoint.rglob("*.bin"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # the last byte of the last tensor
    weights.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "change", [_graph_rewritten, _checkpoint_file_added, _checkpoint_weights_changed]
)
def test_a_changed_graph_or_checkpoint_is_checked_again(
    export: Path,
    checkpoint: Path,
    torch_checks: list[Path],
    change: Callable[[Path, Path], None],
) -> None:
    parity_record.checked(checkpoint, export, PARITY_MIN_COSINE)
    assert len(torch_checks) == 1
    change(export, checkpoint)
    assert parity_record.recorded(checkpoint, export, PARITY_MIN_COSINE) is None
    _, from_record = parity_record.checked(checkpoint, export, PARITY_MIN_COSINE)
    assert not from_record and len(torch_checks) == 2


def test_an_export_inside_its_checkpoint_is_not_part_of_the_checkpoint(
    fp32_export: Path, checkpoint: Path, torch_checks: list[Path]
) -> None:
    """``encoder export --out <checkpoint>/onnx/model.onnx``: its record, written there,
    does not change the checkpoint it vouches for."""
    inside = Path(shutil.copytree(fp32_export.parent, checkpoint / "onnx")) / "model.onnx"
    (inside.parent / parity_record.PARITY_FILE).unlink(missing_ok=True)
    parity_record.checked(checkpoint, inside, PARITY_MIN_COSINE)
    _, from_record = parity_record.checked(checkpoint, inside, PARITY_MIN_COSINE)
    assert from_record and torch_checks == [inside]


def test_a_record_at_a_lower_threshold_or_failed_does_not_count(
    export: Path, checkpoint: Path
) -> None:
    report = check_parity(checkpoint, export, threshold=0.99)
    assert parity_record.write(checkpoint, export, report) is not None
    assert parity_record.recorded(checkpoint, export, 0.99) is not None
    assert parity_record.recorded(checkpoint, export, PARITY_MIN_COSINE) is None  # 0.9999
    path = export.parent / parity_record.PARITY_FILE
    path.unlink()
    failed = ParityReport(report.cosines, threshold=1.01)  # no graph reaches it
    assert parity_record.write(checkpoint, export, failed) is None and not path.exists()
    path.write_text("{not json")
    assert parity_record.recorded(checkpoint, export, 0.99) is None
