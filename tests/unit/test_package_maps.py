"""Each package's ``__init__.py`` is its map: a docstring naming every module and
subpackage it holds (as ````name```` or ``:mod:`.name```), each with its one role
(issue #32). A module added without a line in the map fails here, so the map a newcomer
reads first stays true."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = sorted(p.parent for p in (ROOT / "services").rglob("__init__.py"))


def _members(package: Path) -> list[str]:
    modules = [p.stem for p in package.glob("*.py") if p.name != "__init__.py"]
    subpackages = [p.parent.name for p in package.glob("*/__init__.py")]
    return sorted(modules + subpackages)


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_package_map_names_every_module(package: Path) -> None:
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text(encoding="utf-8")))
    assert doc, f"{package.relative_to(ROOT)}/__init__.py has no package map"
    missing = [
        name
        for name in _members(package)
        if f"``{name}" not in doc and f":mod:`.{name}`" not in doc and f":mod:`.{name}/`" not in doc
    ]
    assert missing == [], f"{package.relative_to(ROOT)}/__init__.py does not name {missing}"
