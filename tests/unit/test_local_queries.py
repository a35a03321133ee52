"""Which repository versions the gateway runs queries of itself (local_queries.query_graph)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.encoder.runtime.local_queries import query_graph


def _version(root: Path, config: str, described: dict[str, str], files: tuple[str, ...]) -> Path:
    model = root / "embed"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(config)
    (model / "1" / "version.json").write_text(json.dumps(described))
    for name in files:
        (model / "1" / name).write_bytes(b"")
    return model / "1"


def test_a_python_backend_version_runs_its_query_graph(tmp_path: Path) -> None:
    folder = _version(
        tmp_path,
        'name: "embed"\nbackend: "python"\n',
        {"digest": "ab", "onnx_file": "model.onnx"},
        ("model.onnx", "encoder.json"),
    )
    assert query_graph(tmp_path, "embed", 1, "ab") == (folder, folder / "model.onnx")


@pytest.mark.parametrize(
    ("config", "described", "files", "why"),
    [
        ('name: "embed"\nplatform: "tensorrt_plan"\n', {}, ("model.plan",), "platform"),
        ('name: "embed"\nbackend: "python"\n', {"digest": "cd"}, ("model.onnx",), "digest cd"),
        ('name: "embed"\nbackend: "python"\n', {"digest": "ab"}, ("model.onnx",), "encoder.json"),
    ],
)
def test_a_version_it_cannot_vouch_for_is_refused_with_the_reason(
    tmp_path: Path, config: str, described: dict[str, str], files: tuple[str, ...], why: str
) -> None:
    _version(tmp_path, config, described, files)
    with pytest.raises(ValueError, match=why):
        query_graph(tmp_path, "embed", 1, "ab")


def test_a_missing_version_folder_is_refused(tmp_path: Path) -> None:
    _version(tmp_path, 'backend: "python"\n', {}, ("model.onnx", "encoder.json"))
    with pytest.raises(ValueError, match="not readable"):
        query_graph(tmp_path, "embed", 2, "")
