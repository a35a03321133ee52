"""The BEIR folder of one evaluation, as arrays: queries, documents, their embeddings."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.common.errors import InvalidArgument
from services.corpus.beir import BeirData, load_beir
from services.encoder.embeddings import Encode, beside_corpus, embed_cached, torch_encoder
from services.encoder.profiles import Kind
from services.eval.config import EvalConfig


@dataclass(frozen=True)
class EvalData:
    beir: BeirData
    qids: list[str]  # the evaluated queries (with at least one relevant document), sorted
    model: str
    doc_vectors: np.ndarray  # rows in ``beir.doc_ids`` order
    query_vectors: np.ndarray  # rows in ``qids`` order


def default_model_name() -> str:
    from services.encoder.model import default_model_dir, model_name_of

    return str(model_name_of(default_model_dir()))


def load(cfg: EvalConfig, need_vectors: bool = True) -> EvalData:
    """Read the folder; embed its documents and queries (cached) when ``need_vectors``."""
    beir = load_beir(Path(cfg.data_dir), cfg.split)
    qids = sorted(q for q, rels in beir.qrels.items() if rels)
    if cfg.max_queries is not None:
        if cfg.max_queries < 1:
            raise InvalidArgument("max_queries must be >= 1")
        qids = qids[: cfg.max_queries]
    if not qids:
        raise InvalidArgument(
            f"{cfg.data_dir}: no query of split {cfg.split!r} has a relevant document in the corpus"
        )
    model = default_model_name()
    empty = np.zeros((0, 0), dtype=np.float32)
    if not need_vectors:
        return EvalData(beir, qids, model, empty, empty)
    encode = _LazyEncoder(cfg.threads)
    docs = beside_corpus(beir.root, model, len(beir.doc_ids))
    if docs is None:
        texts = [beir.docs[d] for d in beir.doc_ids]
        docs = embed_cached(texts, "document", model, encode, cfg.cache_dir, cfg.progress)
    texts = [beir.queries[q] for q in qids]
    queries = embed_cached(texts, "query", model, encode, cfg.cache_dir, cfg.progress)
    return EvalData(beir, qids, model, docs, queries)


class _LazyEncoder:
    """Loads the model on the first text it must encode (a warm cache loads nothing)."""

    def __init__(self, threads: int | None) -> None:
        self.threads = threads
        self._encode: Encode | None = None

    def __call__(self, texts: list[str], kind: Kind) -> np.ndarray:
        if self._encode is None:
            self._encode = torch_encoder(self.threads)[1]
        return self._encode(texts, kind)
