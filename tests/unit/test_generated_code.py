"""The generated package must match what protos/ generates now, and carry the contract's
one version (protos/VERSION), which the SDK's distribution and the server's pin follow."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from tests.support.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


def _gen_module() -> ModuleType:
    return load_script(ROOT / "scripts" / "gen_protos.py")


def test_generated_code_is_fresh() -> None:
    gen = _gen_module()
    stale = gen.stale_files(gen.OUT, gen.ROOT / gen.OPENAPI)
    assert stale == [], f"run scripts/gen_protos.py; stale: {stale}"


def test_staleness_is_detected(tmp_path: Path) -> None:
    gen = _gen_module()
    gen.generate(tmp_path, tmp_path / gen.OPENAPI)
    target = tmp_path / "retrieval" / "v1" / "search_pb2.py"
    target.write_text(target.read_text() + "\n# hand edit\n")
    assert "retrieval/v1/search_pb2.py" in gen.stale_files(tmp_path)


def test_a_stale_openapi_document_is_detected(tmp_path: Path) -> None:
    gen = _gen_module()
    doc = tmp_path / "docs" / "openapi.json"
    gen.generate(tmp_path, doc)
    doc.write_text(doc.read_text().replace('"/v1/search"', '"/v1/find"'))
    assert gen.stale_files(tmp_path) == ["docs/openapi.json"]


def test_one_contract_version_for_the_generated_package_the_sdk_and_the_server() -> None:
    """protos/VERSION is written once: the generated ``retrieval.__version__`` is it (the
    staleness test holds that), the SDK's distribution reads its version from there, and
    the server's distribution pins exactly that SDK."""
    import tomllib

    import retrieval

    version = _gen_module().contract_version()
    assert retrieval.__version__ == version
    sdk = tomllib.loads((ROOT / "clients/python/pyproject.toml").read_text())
    assert sdk["project"]["dynamic"] == ["version"]
    assert sdk["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "retrieval.__version__"}
    server = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"gtr-retrieval-client=={version}" in server


def test_the_contract_major_is_the_protos_package_version(tmp_path: Path) -> None:
    import pytest

    gen = _gen_module()
    major = int(gen.contract_version().split(".")[0])
    assert (ROOT / "protos" / "retrieval" / f"v{major}").is_dir()
    version_file = tmp_path / "VERSION"
    vars(gen)["VERSION_FILE"] = version_file  # the script reads its module global
    for wrong in (f"{major + 1}.0.0", "1.0", "v1.0.0"):
        version_file.write_text(wrong + "\n")
        with pytest.raises(SystemExit):
            gen.contract_version()
