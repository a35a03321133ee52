"""The int8 query tower (issue #34): a dynamically quantized query graph beside the FP32
document graph, and the two gates that decide whether an export may carry it.

``encoder export --query-precision int8`` quantizes the **query tower only** (ONNX
Runtime ``quantize_dynamic``, int8 weights, per-channel scales): the FP32 graph stays
``model.onnx`` and embeds documents, the int8 graph is ``query.int8.onnx`` and embeds
queries. Stored vectors and indexes are therefore unchanged; only query vectors move.
``encoder.json`` records it with the two-tower ``towers`` mapping (so the in-process
embedder, the Triton repository and ``encoder publish`` serve each kind with its own
graph, as for a trained two-tower checkpoint) and ``query_precision: "int8"``; the
graphs' digest (``export_digest``) therefore differs from the FP32 export's, and so does
every ``EncoderSpec.identity()`` built from it.

Gates, run at export before anything is written beside ``model.onnx``:

* parity: the int8 graph against the FP32 graph on :data:`PARITY_TEXTS`, min row
  cosine ≥ :data:`INT8_PARITY_MIN_COSINE` (the FP32 export's own gate, 0.9999 against
  PyTorch, is one no int8 graph can meet; all-MiniLM-L6-v2 with 7-bit weights: 0.9878
  on these texts, min 0.9877 over SciFact's 162 dev queries);
* quality: dev nDCG@10 (SciFact, ``split_queries(sorted(query ids), 13, 0.2)``, exact
  search over the FP32 document vectors) of the int8 query graph within
  :data:`QUALITY_MAX_DROP` of the FP32 graph's. Measured with the data given
  (``--quality-data``); else taken from the committed record when it holds for these
  very graphs (:mod:`services.encoder.build.int8_record`: the default model's); else
  measured on ``$GTR_DATA_DIR/scifact`` when it is there; else the int8 tower is refused
  (FailedPrecondition): a model whose quality nobody measured gets no int8 queries.

Served one query per graph run: dynamic quantisation scales each activation tensor by
its own range, and that tensor is the whole batch, so a query's int8 vector would depend
on the other rows (and their padding) it was batched with. Row by row it depends on the
query alone, as an FP32 vector does (measured on SciFact dev: batches of 32 lost 0.0062
nDCG@10, rows one at a time 0.0011). The in-process embedder and the Triton CPU model
both run an int8 query tower that way (:data:`ROW_BY_ROW`).

Both results are written to ``query_int8.json`` beside the export (with the quality
result's source: measured on which data, or ``recorded``). A failed gate raises
FailedPrecondition and the export folder is left as it was.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from services.common.errors import FailedPrecondition, InvalidArgument
from services.encoder.build import int8_record
from services.encoder.build.document_int8 import gate_int8_documents
from services.encoder.build.export import (
    GATE_FILE,
    INT8_ONNX,
    INT8_QUERY_ONNX,
    ONNX_OPSET,
    EncoderMeta,
    export_onnx,
    onnx_session,
    quantize_int8,
    row_cosines,
)
from services.encoder.build.int8_quality import (
    QUALITY_MAX_DROP as QUALITY_MAX_DROP,  # re-exported: the limit both gates share
)
from services.encoder.build.int8_quality import (
    QualityResult,
    check_document_vectors,
    default_quality_data,
    dev_split,
    embed_texts,
    export_codec,
    fp32_document_vectors,
    paired_dev_ndcg,
    parity_problem,
    quality_dict,
)

# min cosine of the int8 query graph vs the FP32 graph on PARITY_TEXTS (all-MiniLM-L6-v2,
# 7-bit weights: 0.9878); on SciFact's 162 dev queries, one per run, min 0.9877 / mean
# 0.9923 (python -m bench.query_int8, 2026-12-01)
INT8_PARITY_MIN_COSINE = 0.98
# an export's query_precision whose query graph runs one row at a time (see above)
ROW_BY_ROW = "int8"

# Query-like texts, short and long, in one padded batch.
PARITY_TEXTS = [
    "what is a dual encoder",
    "x",
    "how many layers does t5 base have?",
    "does vitamin d supplementation reduce the risk of fractures in older adults",
    "0-dimensional biomaterials show inductive properties.",
    "Large dual encoders are generalizable retrievers: scaling the encoder while keeping "
    "the bottleneck embedding fixed improves out-of-domain retrieval.",
    "temporary directory cleanup",
    "Is the risk of cancer higher in smokers who also drink alcohol?",
]


@dataclass(frozen=True)
class GateRecord:
    """``query_int8.json``: what the gates measured when the export was made."""

    parity_min_cosine: float
    parity_mean_cosine: float
    parity_threshold: float
    parity_rows: int
    # QualityResult as a dict plus drop/passed (and "recorded": the record's file when
    # taken from it instead of measured here)
    quality: dict[str, Any]
    quality_note: str = ""
    parity_cosines: list[float] = field(default_factory=list)  # per probe query
    made_at: float = field(default_factory=time.time)
    # int8 documents' gates (document_int8.gate_int8_documents); empty: FP32 documents
    documents: dict[str, Any] = field(default_factory=dict)
    # the graphs gated (int8_record.gate_graphs): a publish takes the record for these only
    graphs: dict[str, str] = field(default_factory=dict)

    def write(self, folder: Path) -> None:
        (Path(folder) / GATE_FILE).write_text(json.dumps(asdict(self), indent=2) + "\n")


class _NoPreprocessingHint(logging.Filter):
    """ONNX Runtime's quantizer logs a pre-processing hint on the root logger at every
    call; the graph is gated by measurement instead (parity and quality)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "pre-processing before quantization" not in record.getMessage()


def quantize_query_graph(fp32_onnx: Path, out: Path) -> Path:
    """Dynamic int8 quantisation (int8 weights, per-channel scales) of ``fp32_onnx``."""

    hint = _NoPreprocessingHint()
    logging.getLogger().addFilter(hint)
    try:
        return quantize_int8(Path(fp32_onnx), Path(out))
    finally:
        logging.getLogger().removeFilter(hint)


def parity_cosines(fp32_onnx: Path, int8_onnx: Path, texts: list[str] | None = None) -> np.ndarray:
    """Per-text cosine of the int8 query graph's vectors with the FP32 graph's (one query
    per run, as served); the export folder of ``fp32_onnx`` gives the tokenizer.
    NaN, Inf or zero rows come out as NaN, which fails every threshold."""

    codec = export_codec(Path(fp32_onnx).parent)
    texts = list(texts or PARITY_TEXTS)
    reference = embed_texts(onnx_session(fp32_onnx), codec, texts, "query", batch=1)
    got = embed_texts(onnx_session(int8_onnx), codec, texts, "query", batch=1)
    if got.shape != reference.shape:
        return np.full(len(texts), np.nan)
    with np.errstate(invalid="ignore"):
        cosines = np.asarray(row_cosines(reference, got), dtype=np.float64)
    return np.where(np.isfinite(got).all(axis=1), cosines, np.nan)


def check_int8_parity(
    fp32_onnx: Path, int8_onnx: Path, threshold: float = INT8_PARITY_MIN_COSINE
) -> tuple[np.ndarray, str | None]:
    """(cosines, why the int8 graph is refused or None)."""
    cosines = parity_cosines(fp32_onnx, int8_onnx)
    problem = parity_problem(cosines, threshold, "query texts")
    return cosines, None if problem is None else f"int8 query graph: {problem}"


def dev_ndcg(
    fp32_onnx: Path,
    int8_onnx: Path,
    data_dir: Path,
    doc_vectors: np.ndarray | None = None,
    threads: int | None = 1,
    batch: int = 1,
) -> QualityResult:
    """Dev nDCG@10 (exact search) of the FP32 and the int8 query graph over the same
    document vectors (:func:`~services.encoder.build.int8_quality.fp32_document_vectors`)."""
    from services.corpus.beir import load_beir

    export_dir = Path(fp32_onnx).parent
    meta = EncoderMeta.read(export_dir)
    codec = export_codec(export_dir)
    data = load_beir(Path(data_dir))
    dev = dev_split(data)
    if doc_vectors is None:
        texts = [data.docs[d] for d in data.doc_ids]
        doc_vectors = fp32_document_vectors(fp32_onnx, data_dir, data.doc_ids, texts, threads)
    check_document_vectors(doc_vectors, data, meta, data_dir)
    texts = [data.queries[q] for q in dev]
    fp32, int8 = (
        embed_texts(onnx_session(path, threads), codec, texts, "query", batch=batch)
        for path in (fp32_onnx, int8_onnx)
    )
    return paired_dev_ndcg(data, dev, data_dir, (fp32, doc_vectors), (int8, doc_vectors), batch)


def gate_int8_query(fp32_onnx: Path, int8_onnx: Path, quality_data: Path | None) -> GateRecord:
    """Both gates on an export folder holding both graphs; FailedPrecondition when one
    refuses (the caller writes nothing then). The quality gate measures on
    ``quality_data`` when given; else the committed record of these graphs answers;
    else ``$GTR_DATA_DIR/scifact``; with none of them the int8 tower is refused."""
    cosines, problem = check_int8_parity(fp32_onnx, int8_onnx)
    if problem:
        raise FailedPrecondition(f"the int8 query tower is refused: {problem}")
    note = ""
    if quality_data is None:
        model_name = EncoderMeta.read(Path(fp32_onnx).parent).model_name
        record, why = int8_record.find_record(model_name, fp32_onnx, int8_onnx, cosines.tolist())
        if record is not None:
            quality = {
                **record.quality,
                "recorded": int8_record.RECORD_FILE.name,
                "recorded_at": record.made_at,
            }
            note = (
                f"quality: the result recorded for these graphs ({int8_record.RECORD_FILE.name},"
                f" {record.made_at}), not measured here"
            )
        else:
            quality_data = default_quality_data()
            if quality_data is None:
                raise FailedPrecondition(
                    f"the int8 query tower is refused: its quality is not measured ({why}) and "
                    "there is no BEIR data to measure it on: pass --quality-data DIR or set "
                    "GTR_DATA_DIR (SciFact), or keep FP32 queries (--query-precision fp32)"
                )
    if quality_data is not None:
        result = dev_ndcg(fp32_onnx, int8_onnx, quality_data)
        if not result.passed:
            raise FailedPrecondition(
                f"the int8 query tower is refused: dev nDCG@10 {result.int8_ndcg_at_10:.4f} "
                f"vs FP32 {result.fp32_ndcg_at_10:.4f} (drop {result.drop:.4f} > "
                f"{result.max_drop}) on {result.queries} queries of {quality_data}"
            )
        quality = quality_dict(result)
    return GateRecord(
        parity_min_cosine=round(float(cosines.min()), 5),
        parity_mean_cosine=round(float(cosines.mean()), 5),
        parity_threshold=INT8_PARITY_MIN_COSINE,
        parity_rows=len(cosines),
        quality=quality,
        quality_note=note,
        parity_cosines=[float(c) for c in cosines],
    )


def export_with_int8_query(
    model_dir: Path,
    onnx_path: Path,
    quality_data: Path | None,
    opset: int | None = None,
    *,
    documents: bool = False,
) -> EncoderMeta:
    """The FP32 export plus the int8 query graph (``documents``: serving documents too),
    made and gated in a scratch folder beside ``onnx_path`` and moved into place only
    when every gate passes."""
    from services.encoder.model import tower_dirs

    dirs = tower_dirs(model_dir)
    if dirs["query"] != dirs["document"]:
        raise InvalidArgument(
            f"{model_dir} is a two-tower checkpoint: an int8 query tower is only made for "
            "one-tower checkpoints so far; export it with --query-precision fp32"
        )
    made_folder = not onnx_path.parent.exists()
    onnx_path.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".int8-export-", dir=onnx_path.parent))
    try:
        fp32 = work / onnx_path.name
        export_onnx(model_dir, fp32, opset=opset if opset is not None else ONNX_OPSET)
        meta = add_int8_query_tower(fp32, quality_data, documents=documents)
        for name in (onnx_path.name, _int8_name(documents), "tokenizer.json", GATE_FILE):
            os.replace(work / name, onnx_path.parent / name)
        os.replace(work / "encoder.json", onnx_path.parent / "encoder.json")  # last: the switch
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        if made_folder:  # a refused export leaves no folder behind (up's "auto" reads it)
            shutil.rmtree(onnx_path.parent, ignore_errors=True)
        raise
    shutil.rmtree(work, ignore_errors=True)
    return meta


def _int8_name(documents: bool) -> str:
    return INT8_ONNX if documents else INT8_QUERY_ONNX


def add_int8_query_tower(
    fp32_onnx: Path, quality_data: Path | None, *, documents: bool = False
) -> EncoderMeta:
    """Quantize the FP32 one-tower export at ``fp32_onnx`` into ``query.int8.onnx`` beside
    it (``documents``: ``model.int8.onnx``, serving documents too), run the gates
    (``documents``: :mod:`~services.encoder.build.document_int8`'s as well), and only when
    they pass write ``query_int8.json`` and the ``encoder.json`` that serves with it
    (FailedPrecondition otherwise, with the int8 graph removed and ``encoder.json`` as it
    was)."""
    fp32_onnx = Path(fp32_onnx)
    meta = EncoderMeta.read(fp32_onnx.parent)
    if meta.towers:
        raise InvalidArgument(
            f"{fp32_onnx.parent} already has towers {meta.towers}: an int8 query tower is "
            "added to a one-tower FP32 export only"
        )
    int8 = fp32_onnx.parent / _int8_name(documents)
    try:
        quantize_query_graph(fp32_onnx, int8)
        record = gate_int8_query(fp32_onnx, int8, quality_data)
        if documents:
            record = replace(record, documents=gate_int8_documents(fp32_onnx, int8, quality_data))
    except BaseException:
        int8.unlink(missing_ok=True)
        raise
    meta = replace(
        meta,
        towers={"query": int8.name, "document": int8.name if documents else fp32_onnx.name},
        query_precision="int8",
        document_precision="int8" if documents else "fp32",
    )
    replace(record, graphs=int8_record.gate_graphs(fp32_onnx, int8)).write(fp32_onnx.parent)
    meta.write(fp32_onnx.parent)
    return meta
