"""What the int8 gates share (query_int8.py, document_int8.py): the dev split, the
quality limit and result, the BEIR data they measure on, embedding rows with a graph."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from services.encoder.build.export import OUTPUT_NAME, EncoderMeta, onnx_session, row_cosines

# dev nDCG@10 of int8 queries may be at most this much below FP32's (measured: −0.0011)
QUALITY_MAX_DROP = 0.003
DEV_SEED = 13  # the eval's dev split of the queries
DEV_FRACTION = 0.2


def default_quality_data() -> Path | None:
    """SciFact under ``$GTR_DATA_DIR`` (the shared data), or None when it is not there."""
    root = os.environ.get("GTR_DATA_DIR")
    path = Path(root) / "scifact" if root else None
    return path if path is not None and (path / "queries.jsonl").exists() else None


@dataclass(frozen=True)
class QualityResult:
    """Dev nDCG@10 of the FP32 and int8 query graphs on the same queries and documents."""

    data: str
    queries: int
    fp32_ndcg_at_10: float
    int8_ndcg_at_10: float
    paired: dict[str, Any]  # services.measures.ranking.paired_comparison (int8 vs FP32)
    batch: int = 1  # queries per graph run (1: how they are served, see ROW_BY_ROW)
    max_drop: float = QUALITY_MAX_DROP

    @property
    def drop(self) -> float:
        return self.fp32_ndcg_at_10 - self.int8_ndcg_at_10

    @property
    def passed(self) -> bool:
        return self.drop <= self.max_drop


def parity_problem(cosines: np.ndarray, threshold: float, texts: str) -> str | None:
    """Why an int8 graph whose probe ``texts`` ("query texts", "document texts") came out
    at ``cosines`` against the FP32 graph is refused, or None (NaN fails every threshold)."""
    worst = float(np.min(cosines))  # NaN propagates
    if worst >= threshold:
        return None
    return f"min cosine vs the FP32 graph {worst:.5f} < {threshold} over {len(cosines)} {texts}"


def embed_texts(
    session: Any, codec: Any, texts: list[str], kind: str, batch: int = 32
) -> np.ndarray:
    """``texts`` as ``kind`` through ``session``, ``batch`` rows per graph run."""
    rows = []
    for i in range(0, len(texts), batch):
        tokens = codec.encode(texts[i : i + batch], kind)
        feeds = {"input_ids": tokens.input_ids, "attention_mask": tokens.attention_mask}
        rows.append(np.asarray(session.run([OUTPUT_NAME], feeds)[0], dtype=np.float32))
    return np.concatenate(rows) if rows else np.zeros((0, 0), dtype=np.float32)


def export_codec(export_dir: Path) -> Any:
    """The tokenizer of the export folder ``export_dir``."""
    from services.encoder.textcodec import TextCodec

    meta = EncoderMeta.read(export_dir)
    return TextCodec.from_file(str(export_dir / "tokenizer.json"), meta.max_lens, meta.pad_id)


def quality_dict(result: QualityResult) -> dict[str, Any]:
    return {**asdict(result), "drop": round(result.drop, 4), "passed": result.passed}


# a cached corpus vector may differ from the FP32 graph's by this much (batching, padding)
CACHE_MIN_COSINE = 0.999
CACHE_PROBES = 8  # documents re-encoded to check a cache against the graph


def fp32_document_vectors(
    fp32_onnx: Path, data_dir: Path, doc_ids: list[str], texts: list[str], threads: int | None = 1
) -> np.ndarray:
    """The FP32 graph's vectors of the corpus: ``corpus.<model>.npy`` in ``data_dir`` (the
    shared data's) when it holds this very model's vectors (its first
    :data:`CACHE_PROBES` rows within :data:`CACHE_MIN_COSINE` of the graph's: a checkpoint
    fine-tuned in a folder of the same name has other vectors), else encoded here."""
    export_dir = Path(fp32_onnx).parent
    meta = EncoderMeta.read(export_dir)
    session, codec = onnx_session(fp32_onnx, threads), export_codec(export_dir)
    cached = Path(data_dir) / f"corpus.{meta.model_name}.npy"
    if cached.exists():
        vectors = np.load(cached)
        if vectors.shape == (len(doc_ids), meta.dim):
            probe = embed_texts(session, codec, texts[:CACHE_PROBES], "document")
            if min(row_cosines(vectors[:CACHE_PROBES], probe)) >= CACHE_MIN_COSINE:
                return np.asarray(vectors, dtype=np.float32)
    return embed_texts(session, codec, texts, "document")


def dev_split(data: Any) -> list[str]:
    """The eval's dev queries of a loaded BEIR folder (those with qrels)."""
    from services.corpus.beir import split_queries

    _, dev = split_queries(sorted(data.queries), DEV_SEED, DEV_FRACTION)
    return [q for q in dev if q in data.qrels]


def check_document_vectors(vectors: np.ndarray, data: Any, meta: EncoderMeta, where: Path) -> None:
    """FailedPrecondition unless ``vectors`` hold one ``meta.dim`` row per corpus document."""
    from services.common.errors import FailedPrecondition

    if vectors.shape != (len(data.doc_ids), meta.dim):
        raise FailedPrecondition(
            f"document vectors {vectors.shape} do not fit {where} "
            f"({len(data.doc_ids)} documents) and {meta.model_name} ({meta.dim}-d)"
        )


def paired_dev_ndcg(
    data: Any,
    dev: list[str],
    where: Path,
    fp32: tuple[np.ndarray, np.ndarray],
    int8: tuple[np.ndarray, np.ndarray],
    batch: int = 1,
) -> QualityResult:
    """Dev nDCG@10 of exact search with FP32 against int8 (query vectors, document
    vectors), per query and paired."""
    from services.measures.ranking import paired_comparison, score

    per: dict[str, list[float]] = {}
    for name, (queries, docs) in (("fp32", fp32), ("int8", int8)):
        top = np.argsort(-(queries @ docs.T), axis=1)[:, :100]
        run = {q: [data.doc_ids[j] for j in top[i]] for i, q in enumerate(dev)}
        per[name] = score(run, data.qrels, dev).values("ndcg_at_10")
    return QualityResult(
        data=str(where),
        queries=len(dev),
        fp32_ndcg_at_10=round(float(np.mean(per["fp32"])), 4),
        int8_ndcg_at_10=round(float(np.mean(per["int8"])), 4),
        paired=paired_comparison(per["fp32"], per["int8"]),
        batch=batch,
    )
