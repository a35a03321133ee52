"""int8 documents (issues #33/#34): the int8 query tower's quantized graph serving
documents too, and the gates that decide whether an export may carry it.

A document encode is the write path's CPU (every upsert) and a new-encoder rollout's
(its re-embedding and the dual write of every upsert). The dynamically quantized graph of
:mod:`~services.encoder.build.query_int8`, run one document per graph run and unpadded,
costs about a third of the FP32 graph in batches of 32 on this CPU (SciFact's documents,
one ONNX Runtime thread; ``bench/results/query_int8.json`` ``documents``), and a batch of
FP32 documents pays for its padding besides.

``encoder export --query-precision int8 --document-precision int8`` writes the quantized
graph as ``model.int8.onnx``, serving both kinds (``towers``), with ``query_precision``
and ``document_precision`` "int8" in ``encoder.json``. Int8 documents come with int8
queries only: the quality gate measures the pair, and an int8 document graph beside an
FP32 query graph is a pair nobody measured.

Gates, after the query tower's (:func:`~services.encoder.build.query_int8.gate_int8_query`)
and before anything is written:

* parity: the int8 graph against the FP32 graph on :data:`DOCUMENT_PARITY_TEXTS`, one
  document per run, min row cosine ≥ :data:`DOCUMENT_PARITY_MIN_COSINE` (the query
  tower's threshold);
* quality: dev nDCG@10 (the eval's dev split, exact search) of int8 queries over int8
  documents within :data:`~services.encoder.build.query_int8.QUALITY_MAX_DROP` of FP32
  queries over FP32 documents: what a stack on this export answers against what the FP32
  export answers. Measured with the data given; else the committed record of these graphs
  when it carries a document result (:mod:`~services.encoder.build.int8_record`); else
  on ``$GTR_DATA_DIR/scifact``; else refused (FailedPrecondition). The live gate encodes
  the whole corpus with the int8 graph (and with the FP32 one unless the data has
  this model's ``corpus.<model>.npy``): minutes on a CPU, at export only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from services.common.errors import FailedPrecondition
from services.encoder.build import int8_record
from services.encoder.build.export import EncoderMeta, onnx_session, row_cosines
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

# min cosine of the int8 graph's document vectors vs the FP32 graph's on
# DOCUMENT_PARITY_TEXTS: the query tower's threshold (all-MiniLM-L6-v2, 7-bit weights:
# 0.9878 on these texts; with 8-bit weights min 0.9905 over SciFact's 5,183 documents
# in a one-off run, not a bench)
DOCUMENT_PARITY_MIN_COSINE = 0.98

# Document-like texts, short to longer than the 256-token window (truncated).
DOCUMENT_PARITY_TEXTS = [
    "Vitamin D supplementation and fracture risk in older adults: a randomized trial.",
    "x",
    "Dual encoders map queries and documents into one vector space; retrieval is a nearest "
    "neighbour search over the document vectors, which are computed once at indexing time.",
    "Background: Smoking and alcohol consumption are established risk factors for cancers "
    "of the upper aerodigestive tract. Methods: We pooled individual data from case-control "
    "studies and estimated odds ratios with logistic regression, adjusting for age, sex and "
    "study centre. Results: Among never-drinkers, smoking raised the risk threefold; among "
    "heavy drinkers who smoked, the risk was more than tenfold that of abstainers. "
    "Conclusions: The two exposures act multiplicatively, which matters for prevention. " * 3,
    "Inverted file indexes with product quantization compress vectors into short codes.",
    "0-dimensional biomaterials show inductive properties in bone tissue engineering.",
]


class DocumentsRefused(FailedPrecondition):
    """A document gate refused int8 documents (the query tower's gates passed)."""


def _embed_rows(onnx_path: Path, texts: list[str], kind: str, threads: int = 1) -> np.ndarray:
    """One unpadded row per graph run, as an int8 tower is served."""
    session, codec = onnx_session(onnx_path, threads), export_codec(Path(onnx_path).parent)
    return embed_texts(session, codec, texts, kind, 1)


def document_parity_cosines(fp32_onnx: Path, int8_onnx: Path) -> np.ndarray:
    """Per-text cosine of the int8 graph's document vectors with the FP32 graph's (NaN for
    a NaN, Inf or zero row, which fails every threshold)."""
    texts = list(DOCUMENT_PARITY_TEXTS)
    reference = _embed_rows(fp32_onnx, texts, "document")
    got = _embed_rows(int8_onnx, texts, "document")
    if got.shape != reference.shape:
        return np.full(len(texts), np.nan)
    with np.errstate(invalid="ignore"):
        cosines = np.asarray(row_cosines(reference, got), dtype=np.float64)
    return np.where(np.isfinite(got).all(axis=1), cosines, np.nan)


def check_document_parity(fp32_onnx: Path, int8_onnx: Path) -> tuple[np.ndarray, str | None]:
    """(the probe cosines, why the int8 graph's documents are refused or None)."""
    cosines = document_parity_cosines(fp32_onnx, int8_onnx)
    return cosines, parity_problem(cosines, DOCUMENT_PARITY_MIN_COSINE, "document texts")


def dev_ndcg_documents(
    fp32_onnx: Path, int8_onnx: Path, data_dir: Path, fp32_docs: np.ndarray | None = None
) -> QualityResult:
    """Dev nDCG@10 of FP32 queries over FP32 documents against int8 queries over int8
    documents, both one row per run."""
    from services.corpus.beir import load_beir

    meta = EncoderMeta.read(Path(fp32_onnx).parent)
    data = load_beir(Path(data_dir))
    dev = dev_split(data)
    texts = [data.docs[d] for d in data.doc_ids]
    if fp32_docs is None:
        fp32_docs = fp32_document_vectors(fp32_onnx, data_dir, data.doc_ids, texts)
    check_document_vectors(fp32_docs, data, meta, data_dir)
    int8_docs = _embed_rows(int8_onnx, texts, "document")
    queries = [data.queries[q] for q in dev]
    fp32 = (_embed_rows(fp32_onnx, queries, "query"), fp32_docs)
    int8 = (_embed_rows(int8_onnx, queries, "query"), int8_docs)
    return paired_dev_ndcg(data, dev, data_dir, fp32, int8)


def gate_int8_documents(
    fp32_onnx: Path, int8_onnx: Path, quality_data: Path | None
) -> dict[str, Any]:
    """Both document gates; their figures (``GateRecord.documents``), or FailedPrecondition
    saying which refused. Quality as the query tower's: the data given, else the record,
    else ``$GTR_DATA_DIR/scifact``, else refused."""
    cosines, problem = check_document_parity(fp32_onnx, int8_onnx)
    if problem:
        raise DocumentsRefused(f"int8 documents are refused: {problem}")
    figures: dict[str, Any] = {
        "parity_min_cosine": round(float(np.min(cosines)), 5),
        "parity_cosines": [float(c) for c in cosines],
    }
    if quality_data is None:
        model_name = EncoderMeta.read(Path(fp32_onnx).parent).model_name
        record, why = int8_record.find_document_record(
            model_name, fp32_onnx, int8_onnx, cosines.tolist()
        )
        if record is not None:
            recorded = {"recorded": int8_record.RECORD_FILE.name, "recorded_at": record.made_at}
            return {**figures, "quality": {**record.document_quality, **recorded}}
        quality_data = default_quality_data()
        if quality_data is None:
            raise DocumentsRefused(
                f"int8 documents are refused: their quality is not measured ({why}) and there "
                "is no BEIR data to measure it on: pass --quality-data DIR or set GTR_DATA_DIR "
                "(SciFact), or keep FP32 documents (--document-precision fp32)"
            )
    result = dev_ndcg_documents(fp32_onnx, int8_onnx, quality_data)
    if not result.passed:
        raise DocumentsRefused(
            f"int8 documents are refused: dev nDCG@10 of int8 queries over int8 documents "
            f"{result.int8_ndcg_at_10:.4f} vs FP32 {result.fp32_ndcg_at_10:.4f} (drop "
            f"{result.drop:.4f} > {result.max_drop}) on {result.queries} queries of {quality_data}"
        )
    return {**figures, "quality": quality_dict(result)}
