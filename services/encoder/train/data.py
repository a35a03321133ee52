"""Training data for the dual encoder: the split, the pairs, hard negatives mined once.

The BEIR folder's ``train`` qrels are the only judgements read (never a test split). The
judged queries are split by query into train and dev with
:func:`services.corpus.beir.split_queries` (sorted ids shuffled by the seed), so the
split is a function of the seed and the qrels alone and is recorded in the manifest.

Hard negatives are mined once with the *base* checkpoint: its exact top-``depth`` over
the whole corpus for each train query, ranks ``skip + 1 … depth`` minus every judged
positive (the top ranks of an unjudged corpus hold false negatives; the one-epoch
baseline of issue #23 used ranks 4–20). The mined lists are cached under
``$GTR_CACHE_DIR/encoder-negatives/`` by base checkpoint, data digest, seed and ranks.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from services.common.errors import InvalidArgument
from services.corpus.beir import BeirData, load_beir, split_queries
from services.corpus.runs import read_run
from services.encoder.embeddings import beside_corpus, cache_dir, embed_cached

log = logging.getLogger(__name__)
SPLIT = "train"


@dataclass(frozen=True)
class TrainingData:
    data: BeirData
    digest: str  # sha256 of corpus.jsonl, queries.jsonl and qrels/train.tsv
    train_qids: list[str]
    dev_qids: list[str]
    pairs: list[tuple[str, str]]  # (train query id, judged document id), sorted


def data_digest(root: Path) -> str:
    h = hashlib.sha256()
    for name in ("corpus.jsonl", "queries.jsonl", f"qrels/{SPLIT}.tsv"):
        h.update(name.encode())
        with (Path(root) / name).open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def ids_digest(ids: list[str]) -> str:
    return hashlib.sha256("\n".join(ids).encode()).hexdigest()[:16]


def load_training_data(root: Path, seed: int, dev_fraction: float) -> TrainingData:
    """Read the train qrels and split their judged queries; refuse data that cannot train."""
    data = load_beir(root, SPLIT)
    judged = sorted(q for q, rels in data.qrels.items() if rels)
    if not judged:
        raise InvalidArgument(
            f"{root}: no query of queries.jsonl has a judged document of corpus.jsonl in "
            f"qrels/{SPLIT}.tsv (check that the ids match)"
        )
    if len(judged) < 2:
        raise InvalidArgument(f"{root}: one judged query cannot be split into train and dev")
    train, dev = split_queries(judged, seed, dev_fraction)
    if not train:
        raise InvalidArgument(f"dev fraction {dev_fraction} leaves no training query")
    pairs = sorted((q, d) for q in train for d in data.qrels[q])
    return TrainingData(data, data_digest(root), train, dev, pairs)


def hold_out(td: TrainingData, holdout: tuple[str, ...]) -> TrainingData:
    """``td`` without the ``holdout`` queries in training (a validation split chosen by the
    caller: ``gtr-retrieval tune`` picks its fusion and rerank settings on them)."""
    if not holdout:
        return td
    unknown = set(holdout) - set(td.train_qids) - set(td.dev_qids)
    if unknown:
        raise InvalidArgument(f"{len(unknown)} held-out query ids are not judged queries")
    if set(holdout) & set(td.dev_qids):
        raise InvalidArgument("a held-out query is a dev query: hold out train queries only")
    kept = set(holdout)
    train = [q for q in td.train_qids if q not in kept]
    if not train:
        raise InvalidArgument("holding out those queries leaves no training query")
    pairs = sorted((q, d) for q in train for d in td.data.qrels[q])
    return replace(td, train_qids=train, pairs=pairs)


def negatives_from_run(td: TrainingData, path: Path, skip: int, depth: int) -> dict[str, list[str]]:
    """Per train query: ranks ``skip+1 … depth`` of a ranked-list file
    (:func:`services.corpus.runs.read_run`: ``tune`` writes its hybrid run), documents
    outside the corpus and judged positives removed. Every train query needs a list."""
    if not 0 <= skip < depth:
        raise InvalidArgument(f"negative ranks {skip + 1}-{depth}: need 0 <= skip < depth")
    run = read_run(path, td.train_qids, set(td.data.doc_ids))
    return {q: [d for d in run[q][skip:depth] if d not in td.data.qrels[q]] for q in run}


def eval_corpus(td: TrainingData, size: int | None, seed: int) -> TrainingData:
    """``td`` with the corpus cut to ``size`` documents for evaluation: every judged
    document of a dev query plus a seeded random sample of the others (None: all).

    A CPU budget cut, the same for every system compared: re-encoding 5,183 SciFact
    documents per variant is most of the cost on a shared 2-core machine. A sample is
    easier than the whole corpus (fewer distractors), so its figures are comparable with
    each other, not with full-corpus ones.
    """
    if size is None or size >= len(td.data.doc_ids):
        return td
    judged = {d for q in td.dev_qids for d in td.data.qrels[q]}
    others = [d for d in td.data.doc_ids if d not in judged]
    keep = judged | set(
        random.Random(f"{seed}:eval-corpus").sample(
            others, max(0, min(len(others), size - len(judged)))
        )
    )
    doc_ids = [d for d in td.data.doc_ids if d in keep]
    data = replace(td.data, doc_ids=doc_ids)
    return replace(td, data=data)


def corpus_vectors(data: BeirData, model_key: str, encode: object, progress: bool) -> np.ndarray:
    """The corpus embedded by a model: ``corpus.<model>.npy`` beside it, else the cache."""
    texts = [data.docs[d] for d in data.doc_ids]
    beside = beside_corpus(data.root, model_key, len(texts))
    if beside is not None:
        return beside
    return embed_cached(texts, "document", model_key, encode, progress=progress)  # type: ignore[arg-type]


def exact_top(queries: np.ndarray, docs: np.ndarray, k: int) -> np.ndarray:
    """Row indices of the ``k`` best documents per query by inner product, best first."""
    k = min(k, docs.shape[0])
    sims = queries @ docs.T
    top = np.argpartition(-sims, k - 1, axis=1)[:, :k]
    order = np.argsort(-np.take_along_axis(sims, top, axis=1), axis=1, kind="stable")
    return np.take_along_axis(top, order, axis=1)


class LazyEncoder:
    """``encode(texts, kind)`` of a checkpoint, loaded on first use (cache hits skip it).

    ``doc_len``: truncate documents to this many tokens instead of the serving limit
    (the profile's); ``key`` then names the length, so the caches do not mix them.
    """

    def __init__(self, model_dir: Path, doc_len: int | None = None) -> None:
        self.model_dir = model_dir
        self.doc_len = doc_len
        self._embedder: object | None = None

    def key(self) -> str:
        base = model_key(self.model_dir)
        return f"{base}-doc{self.doc_len}" if self.doc_len else base

    def __call__(self, texts: list[str], kind: str) -> np.ndarray:
        if self._embedder is None:
            from tokenizers import Tokenizer

            from services.encoder.model import TorchEmbedder
            from services.encoder.textcodec import TextCodec

            embedder = TorchEmbedder(self.model_dir)
            if self.doc_len:
                spec = embedder.tokenizer_spec
                lens = {"query": embedder.codec.max_lens["query"], "document": self.doc_len}
                embedder.codec = TextCodec(
                    Tokenizer.from_str(spec.tokenizer_json), lens, spec.pad_id
                )
            self._embedder = embedder
        return self._embedder.embed(texts, kind)[0]  # type: ignore[attr-defined,no-any-return]


def base_ranks(
    td: TrainingData,
    qids: list[str],
    encode: LazyEncoder,
    key: str,
    depth: int,
    progress: bool,
) -> dict[str, list[str]]:
    """The base model's exact top-``depth`` document ids for each of ``qids``."""
    docs = corpus_vectors(td.data, key, encode, progress)
    texts = [td.data.queries[q] for q in qids]
    queries = embed_cached(texts, "query", key, encode, progress=progress)  # type: ignore[arg-type]
    top = exact_top(queries, docs, depth)
    return {q: [td.data.doc_ids[j] for j in top[row]] for row, q in enumerate(qids)}


def mine_negatives(
    td: TrainingData,
    encode: LazyEncoder,
    key: str,
    skip: int,
    depth: int,
    progress: bool,
) -> dict[str, list[str]]:
    """Per train query: the base model's ranks ``skip+1 … depth``, judged positives removed."""
    if not 0 <= skip < depth:
        raise InvalidArgument(f"negative ranks {skip + 1}-{depth}: need 0 <= skip < depth")
    digest = hashlib.sha256(json.dumps([key, td.digest, td.train_qids, skip, depth]).encode())
    path = cache_dir() / "encoder-negatives" / f"{digest.hexdigest()[:20]}.json"
    if path.exists():
        return {q: list(v) for q, v in json.loads(path.read_text()).items()}
    ranks = base_ranks(td, td.train_qids, encode, key, depth, progress)
    mined = {q: [d for d in ranks[q][skip:depth] if d not in td.data.qrels[q]] for q in ranks}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(mined))
    tmp.replace(path)
    return mined


def model_key(model_dir: Path) -> str:
    """The embedding caches' name of a checkpoint: its name, plus its weights' digest
    unless it is the packaged all-MiniLM-L6-v2 (whose corpus vectors ship beside SciFact)."""
    from services.encoder.model import default_model_dir, model_name_of

    root = Path(model_dir).resolve()
    if root == default_model_dir().resolve():
        return model_name_of(root)
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.name == "manifest.json" or path.name.endswith(".tmp"):
            continue  # the trainer's record, not the model
        if path.is_file() and path.suffix in {".safetensors", ".bin", ".json"}:
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return f"{model_name_of(root)}-{h.hexdigest()[:12]}"
