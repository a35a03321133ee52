"""An export's parity check against its checkpoint, kept beside its graphs (``parity.json``).

``encoder export`` runs the checkpoint in PyTorch and the graph in ONNX Runtime on the same
tokens and refuses an export under the threshold (:func:`~.export.check_parity`). A
publish of that export folder (``encoder publish DIR``, ``index rollout --encoder DIR``)
checked it again whenever the checkpoint was on the publishing machine: PyTorch imported
and the checkpoint loaded, ~4 s of a core for MiniLM (measured 2026-12-01, ~0.7 s of it
the load and the check once PyTorch is imported), on the rollout's CPU while searches are
served; for GTR-xxl a load of its ~4.8-billion-parameter T5 encoder (~19 GB in FP32) on
a machine that serves.

The record makes that re-check unnecessary when nothing it measured has changed: it names
the SHA-256 of every graph of the export (``model.onnx`` and the towers ``encoder.json``
names) and of the checkpoint's files, with the verdict and its threshold. A publish takes
the recorded verdict only when all of these are the same bytes again and the record passed
at a threshold at least the one asked; anything else (no record, a graph or a checkpoint
file changed, added or removed, a lower threshold, a failed verdict) runs the check in
PyTorch as before, and a passing check writes the record for the next publish. Reading
the bytes costs what a load would read, without the load (no PyTorch, no memory for the
weights).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

from services.encoder.build.export import EncoderMeta, ParityReport, check_parity
from services.encoder.build.int8_record import graph_sha256

log = logging.getLogger(__name__)

PARITY_FILE = "parity.json"


def checkpoint_sha256(model_dir: Path, export_dir: Path | None = None) -> str:
    """One SHA-256 over every file under ``model_dir`` (its relative path, size and
    content, in path order), but hidden files and folders (caches, lock files) and the
    files of ``export_dir`` when the export lies inside the checkpoint (its record among
    them)."""
    root = Path(model_dir)
    skip = Path(export_dir).resolve() if export_dir is not None else None
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        relative = path.relative_to(root)
        if any(part.startswith(".") for part in relative.parts):
            continue
        if skip is not None and path.resolve().is_relative_to(skip):
            continue
        digest.update(f"{relative}\t{path.stat().st_size}\t{graph_sha256(path)}\n".encode())
    return digest.hexdigest()


def export_graphs(onnx_path: Path) -> dict[str, str]:
    """File name → SHA-256 of every graph of the export at ``onnx_path``: the graph itself
    and each tower its ``encoder.json`` names (int8 ones included: one changed is reason
    enough to look again)."""
    onnx_path = Path(onnx_path)
    files = {onnx_path}
    if (onnx_path.parent / "encoder.json").exists():
        files |= set(EncoderMeta.read(onnx_path.parent).onnx_files(onnx_path).values())
    return {path.name: graph_sha256(path) for path in sorted(files) if path.exists()}


def write(model_dir: Path, onnx_path: Path, report: ParityReport) -> Path | None:
    """Record a passing ``report`` of ``model_dir`` against the export at ``onnx_path``
    (None, nothing written: it failed, or the folder is read-only, which is logged)."""
    if not report.passed:
        return None
    path = Path(onnx_path).parent / PARITY_FILE
    record = {
        "checkpoint": str(Path(model_dir).resolve()),
        "checkpoint_sha256": checkpoint_sha256(model_dir, path.parent),
        "graphs": export_graphs(onnx_path),
        "threshold": report.threshold,
        "min_cosine": report.min_cosine,
        "cosines": report.cosines,
        "passed": True,
        "made_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        path.write_text(json.dumps(record, indent=2) + "\n")
    except OSError as exc:
        log.info("parity not recorded beside %s (%s): the next publish checks again", path, exc)
        return None
    return path


def recorded(model_dir: Path, onnx_path: Path, threshold: float) -> ParityReport | None:
    """The recorded report when it holds for these very bytes at ``threshold`` (see the
    module), else None."""
    path = Path(onnx_path).parent / PARITY_FILE
    try:
        record: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    try:
        holds = (
            record.get("passed") is True
            and float(record["threshold"]) >= threshold
            and record["graphs"] == export_graphs(onnx_path)
            and record["checkpoint_sha256"] == checkpoint_sha256(model_dir, path.parent)
        )
        cosines = [float(c) for c in record["cosines"]]
    except (KeyError, TypeError, ValueError):
        return None
    if not holds or not cosines or min(cosines) < threshold:
        return None
    return ParityReport(cosines, threshold)


def checked(
    model_dir: Path, onnx_path: Path, threshold: float, *, keep: bool = True
) -> tuple[ParityReport, bool]:
    """(the parity of ``model_dir`` against the export at ``onnx_path``, whether it is the
    record's): the record when it holds (:func:`recorded`), else the check in PyTorch,
    recorded when it passes and ``keep`` (False: an export made for this call only,
    whose record nobody would read, and whose hashing a GTR-xxl would pay in minutes)."""
    report = recorded(model_dir, onnx_path, threshold)
    if report is not None:
        return report, True
    report = check_parity(model_dir, onnx_path, threshold=threshold)
    if keep:
        write(model_dir, onnx_path, report)
    return report, False
