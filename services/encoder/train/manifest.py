"""``manifest.json`` of a checkpoint written by ``encoder train`` (read by ``eval --encoder``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from services.common.errors import NotFound

MANIFEST = "manifest.json"


def write_manifest(out: Path, manifest: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f"{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    tmp.replace(out / MANIFEST)


def read_manifest(checkpoint: Path) -> dict[str, Any]:
    path = Path(checkpoint) / MANIFEST
    if not path.exists():
        raise NotFound(f"{checkpoint}: no {MANIFEST} (not written by `encoder train`)")
    manifest: dict[str, Any] = json.loads(path.read_text())
    return manifest
