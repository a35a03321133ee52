"""An export's int8 graphs, checked again where they are published (``encoder publish``,
``index rollout --encoder DIR``).

An export folder is files anyone can edit: an ``encoder.json`` that names int8 towers is
no proof that ``encoder export`` gated them, nor that the graphs there now are the ones
it gated. So before a publish serves them, :func:`recheck_int8`:

* measures parity again: each int8 graph against the FP32 graph beside it
  (``model.onnx``), one row per run as served, at the export's thresholds
  (:data:`~services.encoder.build.query_int8.INT8_PARITY_MIN_COSINE`,
  :data:`~services.encoder.build.document_int8.DOCUMENT_PARITY_MIN_COSINE`);
* finds a quality result that holds for these very graphs: the export's own gate record
  (``query_int8.json``) when it says every quality gate passed and it is of these graphs
  (their SHA-256, recorded since this check exists; an older record: its probe cosines,
  reproduced here within :data:`~services.encoder.build.int8_record.COSINE_TOLERANCE`),
  else the committed record of these graphs (:mod:`~services.encoder.build.int8_record`).

Quality is not measured again here (minutes: a corpus through both graphs, and data a
serving machine may not have). int8 graphs whose quality nobody measured are refused
(FailedPrecondition, nothing published) unless the publisher says to serve them anyway
(``unmeasured``: ``--int8-unmeasured``); parity is checked either way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from services.common.errors import FailedPrecondition
from services.encoder.build import int8_record
from services.encoder.build.document_int8 import check_document_parity
from services.encoder.build.export import GATE_FILE, EncoderMeta
from services.encoder.build.query_int8 import check_int8_parity

UNMEASURED_FLAG = "--int8-unmeasured"


@dataclass(frozen=True)
class Int8Check:
    """What :func:`recheck_int8` found for graphs it lets through."""

    note: str  # one line: the graphs, and where their quality result came from
    measured: bool  # False: served unmeasured, as asked


def int8_graphs(fp32_onnx: Path, meta: EncoderMeta) -> dict[str, Path]:
    """The int8 graph of each kind the export at ``fp32_onnx`` (its ``meta``) serves that
    way (none for an FP32 export)."""
    files = meta.onnx_files(Path(fp32_onnx))
    return {kind: files[kind] for kind in ("query", "document") if kind in meta.row_by_row()}


def recheck_int8(
    fp32_onnx: Path, meta: EncoderMeta, *, unmeasured: bool = False
) -> Int8Check | None:
    """Parity again and a quality result of these graphs (above) for the export at
    ``fp32_onnx`` (its ``meta``); None for an FP32 export. FailedPrecondition saying why
    the graphs are refused."""
    fp32_onnx = Path(fp32_onnx)
    graphs = int8_graphs(fp32_onnx, meta)
    if not graphs:
        return None
    folder = fp32_onnx.parent
    model_name = meta.model_name
    if not fp32_onnx.is_file() or fp32_onnx in graphs.values():
        raise FailedPrecondition(
            f"{folder}: int8 graphs without the FP32 graph they are gated against "
            f"({fp32_onnx.name}): re-export it with `encoder export --query-precision int8`"
        )
    cosines = _parity(fp32_onnx, graphs)
    found, why = _export_record(folder, fp32_onnx, graphs, cosines)
    if not found:
        found, committed_why = _committed_record(model_name, fp32_onnx, graphs, cosines)
        why = f"{why}; {committed_why}" if committed_why else why
    kinds = " and ".join(f"{kind} ({path.name})" for kind, path in graphs.items())
    if found:
        return Int8Check(f"int8 {kinds}: parity checked again here, quality from {found}", True)
    if unmeasured:
        return Int8Check(
            f"int8 {kinds}: parity checked again here; quality NOT measured ({why}), "
            f"served as asked ({UNMEASURED_FLAG})",
            False,
        )
    raise FailedPrecondition(
        f"{folder}: the int8 {kinds} of {model_name} pass parity here, but no quality result "
        f"holds for them ({why}). Export them where BEIR data is (`encoder export "
        f"--query-precision int8 --quality-data DIR`), publish the FP32 export, or serve them "
        f"unmeasured with {UNMEASURED_FLAG}"
    )


def _parity(fp32_onnx: Path, graphs: dict[str, Path]) -> dict[str, np.ndarray]:
    """Each int8 graph's probe cosines against the FP32 graph; FailedPrecondition below
    the threshold."""
    cosines: dict[str, np.ndarray] = {}
    if "query" in graphs:
        cosines["query"], problem = check_int8_parity(fp32_onnx, graphs["query"])
        if problem:
            raise FailedPrecondition(f"{fp32_onnx.parent}: refused, {problem}")
    if "document" in graphs:
        cosines["document"], problem = check_document_parity(fp32_onnx, graphs["document"])
        if problem:
            raise FailedPrecondition(f"{fp32_onnx.parent}: refused, int8 document graph: {problem}")
    return cosines


def _export_record(
    folder: Path, fp32_onnx: Path, graphs: dict[str, Path], cosines: dict[str, np.ndarray]
) -> tuple[str, str]:
    """(where the quality came from, "") when the export's gate record holds for these
    graphs and says every quality gate passed; else ("", why not)."""
    path = folder / GATE_FILE
    if not path.is_file():
        return "", f"the export has no gate record ({GATE_FILE})"
    try:
        record: dict[str, Any] = json.loads(path.read_text())
    except ValueError as exc:
        return "", f"its {GATE_FILE} is not JSON ({exc})"
    parts = {"query": record, "document": record.get("documents") or {}}
    for kind, graph in graphs.items():
        part = parts[kind]
        if not (part.get("quality") or {}).get("passed"):
            return "", f"its {GATE_FILE} holds no passed quality gate for {kind} int8"
        recorded_graphs = record.get("graphs")
        if recorded_graphs:
            if recorded_graphs != int8_record.gate_graphs(fp32_onnx, graph):
                return "", f"its {GATE_FILE} is of other graphs (SHA-256)"
        else:  # a record from before ``graphs``: of these graphs if it reproduces here
            off = int8_record.off_by(part.get("parity_cosines") or [], cosines[kind].tolist())
            if not off <= int8_record.COSINE_TOLERANCE:  # NaN: not reproduced
                return "", f"its {GATE_FILE}'s {kind} probe cosines are not reproduced here"
    return f"the export's {GATE_FILE}", ""


def _committed_record(
    model_name: str, fp32_onnx: Path, graphs: dict[str, Path], cosines: dict[str, np.ndarray]
) -> tuple[str, str]:
    """(where the quality came from, "") when the committed record holds for every int8
    kind here; else ("", why not)."""
    for kind, graph in graphs.items():
        find = int8_record.find_record if kind == "query" else int8_record.find_document_record
        record, why = find(model_name, fp32_onnx, graph, cosines[kind].tolist())
        if record is None:
            return "", why
    return f"the committed record ({int8_record.RECORD_FILE.name})", ""
