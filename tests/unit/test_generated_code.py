"""The generated package must match what protos/ generates now."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from tests.support.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


def _gen_module() -> ModuleType:
    return load_script(ROOT / "scripts" / "gen_protos.py")


def test_generated_code_is_fresh() -> None:
    stale = _gen_module().stale_files(ROOT)
    assert stale == [], f"run scripts/gen_protos.py; stale: {stale}"


def test_staleness_is_detected(tmp_path: Path) -> None:
    gen = _gen_module()
    gen.generate(tmp_path)
    target = tmp_path / "retrieval" / "v1" / "search_pb2.py"
    target.write_text(target.read_text() + "\n# hand edit\n")
    assert "retrieval/v1/search_pb2.py" in gen.stale_files(tmp_path)


def test_a_stale_openapi_document_is_detected(tmp_path: Path) -> None:
    gen = _gen_module()
    gen.generate(tmp_path)
    doc = tmp_path / "docs" / "openapi.json"
    doc.write_text(doc.read_text().replace('"/v1/search"', '"/v1/find"'))
    assert gen.stale_files(tmp_path) == ["docs/openapi.json"]
