"""The first ``up`` on a run directory: encode the corpus once, train on it, store it.

Before, the first run encoded a sample of the corpus through Triton to train IVF-PQ
(minutes, silently), then the ingest sent every document through the gateway, which
encoded it again. Now :func:`encode_corpus` encodes every document once, document side,
through the same Triton (or the in-process model), with a progress bar; training takes
its sample from those vectors (:func:`train_on`), and once the shards are up
:func:`store_documents` writes the documents with their vectors through
:class:`ChangeLogWriter`, the gateway's own write path (document hash + log entry in one
script), so nothing is encoded twice. The encoder gets what the gateway would send it
(``Document.embedding_text`` cut by :func:`cut_for_encoder`), so the vectors are the ones
an ingest through the gateway would store. Later runs, and ``gtr-retrieval ingest``, go
through the gateway as before.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.common.domain import Document
from services.common.errors import InvalidArgument
from services.corpus.readers import read_corpus
from services.encoder.texts import cut_for_encoder
from services.generations.registry import EncoderSpec
from services.index.core.train import MIN_TRAIN_VECTORS, TrainOptions, train_index
from services.index.core.trained import Manifest
from services.stack.config import StackConfig

Say = Callable[[str], None]
WRITE_BATCH = 256  # documents per ChangeLogWriter.upsert (the API's upsert limit)


@dataclass(frozen=True)
class CorpusEmbeddings:
    corpus: Path
    docs: list[Document]
    vectors: np.ndarray  # (len(docs), dim) float32, document side, in ``docs`` order
    model: str


def check_trainable(cfg: StackConfig) -> None:
    """Before anything starts: a first run's ``--corpus`` has enough documents to train
    the index on (:data:`MIN_TRAIN_VECTORS`; a small one gets fewer PQ bits, docs/index.md,
    Training), else InvalidArgument naming the file. Reads at most that many documents."""
    from services.index.core.trained import MANIFEST

    if cfg.corpus is None or not cfg.corpus.exists() or (cfg.index_dir / MANIFEST).exists():
        return  # the default corpus has thousands; a missing file is said where it is read
    n = sum(1 for _ in read_corpus(cfg.corpus, limit=MIN_TRAIN_VECTORS))
    if n < MIN_TRAIN_VECTORS:
        raise InvalidArgument(
            f"--corpus {cfg.corpus} has {n} document(s): training the index on the first run "
            f"needs at least {MIN_TRAIN_VECTORS}"
        )


def encoder_text(doc: Document) -> str:
    """What the gateway's upsert sends the encoder for this document."""
    return cut_for_encoder(doc.embedding_text)[0]


def encode_corpus(cfg: StackConfig, corpus: Path, triton_grpc: str, say: Say) -> CorpusEmbeddings:
    """Every document of ``corpus`` encoded once (through Triton when it runs)."""
    docs = list(read_corpus(corpus))
    texts = [encoder_text(d) for d in docs]
    say(f"index      encoding the {len(docs)} documents of {corpus.name} once (first run)")
    start = time.perf_counter()
    vectors, model = asyncio.run(_encode(cfg, triton_grpc, texts))
    say(f"index      {len(docs)} embeddings in {time.perf_counter() - start:.0f} s ({model})")
    return CorpusEmbeddings(corpus, docs, vectors, model)


async def _encode(cfg: StackConfig, triton_grpc: str, texts: list[str]) -> tuple[np.ndarray, str]:
    from tqdm import tqdm

    from services.encoder.base import Encoder

    encoder: Encoder
    if triton_grpc:
        from services.encoder.runtime.triton_client import TritonEncoder, TritonEncoderConfig
        from services.stack.components import internal_tls

        encoder = await TritonEncoder.connect(
            TritonEncoderConfig(url=triton_grpc, default_timeout_s=120.0, tls=internal_tls(cfg))
        )
    else:
        from services.encoder.runtime.inprocess import InProcessEncoder

        encoder = InProcessEncoder.torch()
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))  # similar lengths batch well
    step = max(1, encoder.max_batch)
    rows: list[np.ndarray] = []
    try:
        with tqdm(
            total=len(texts), unit="doc", desc="encode", file=sys.stderr, disable=not cfg.progress
        ) as bar:
            for i in range(0, len(order), step):
                batch = [texts[j] for j in order[i : i + step]]
                rows.append((await encoder.encode(batch, "document")).vectors)
                bar.update(len(batch))
    finally:
        await encoder.close()
    vectors = np.empty((len(texts), encoder.dim), dtype=np.float32)
    if rows:
        vectors[np.asarray(order)] = np.concatenate(rows)
    return vectors, encoder.model_name


def encoder_spec(cfg: StackConfig, triton_grpc: str) -> EncoderSpec:
    """The encoder generation g1's vectors come from, for its record: Triton's ``embed``
    at the version it serves now (pinned: a version published later for a rollout must
    not change what g1's queries are encoded with), or the in-process model (version 0)."""
    from services.index.core.trained import MANIFEST

    if triton_grpc:
        return asyncio.run(_triton_spec(cfg, triton_grpc))
    from services.encoder.model import default_model_dir

    source = str(default_model_dir())
    if not (cfg.index_dir / MANIFEST).exists():
        return EncoderSpec(model=Path(source).name, source=source)
    manifest = Manifest.read(cfg.index_dir)
    return EncoderSpec(model=manifest.model, dim=manifest.dim, source=source)


async def _triton_spec(cfg: StackConfig, triton_grpc: str) -> EncoderSpec:
    from services.encoder.runtime.triton_client import TritonEncoder, TritonEncoderConfig
    from services.stack.components import internal_tls

    encoder = await TritonEncoder.connect(
        TritonEncoderConfig(url=triton_grpc, tls=internal_tls(cfg))
    )
    try:
        return EncoderSpec(
            model=encoder.cfg.model,
            version=encoder.model_version,
            dim=encoder.dim,
            digest=encoder.digest,
            source=encoder.model_name,
        )
    finally:
        await encoder.close()


def train_on(cfg: StackConfig, emb: CorpusEmbeddings, say: Say) -> Manifest:
    """IVF-PQ trained on a seeded sample of ``cfg.train_sample`` of the corpus's vectors."""
    rows = list(range(len(emb.docs)))
    random.Random(0).shuffle(rows)
    sample = emb.vectors[sorted(rows[: cfg.train_sample])]
    say(f"index      training IVF-PQ on {len(sample)} of them")
    manifest = train_index(sample, cfg.index_dir, TrainOptions(model=emb.model))
    say(f"index      {manifest.factory}, nprobe {manifest.nprobe}")
    return manifest


def store_documents(
    redis_url: str, num_shards: int, emb: CorpusEmbeddings, progress: bool = True
) -> int:
    """Write every document with its vector (document + log entry, as the gateway does)."""
    from tqdm import tqdm

    from services.index.client.writer import ChangeLogWriter, DocRecord

    async def run() -> int:
        writer = ChangeLogWriter.connect(redis_url, num_shards=num_shards, dim=emb.vectors.shape[1])
        try:
            with tqdm(
                total=len(emb.docs),
                unit="doc",
                desc="ingest",
                file=sys.stderr,
                disable=not progress,
            ) as bar:
                for i in range(0, len(emb.docs), WRITE_BATCH):
                    batch = emb.docs[i : i + WRITE_BATCH]
                    await writer.upsert(
                        [
                            DocRecord(d.id, emb.vectors[i + n], d.title, d.text, dict(d.metadata))
                            for n, d in enumerate(batch)
                        ]
                    )
                    bar.update(len(batch))
        finally:
            await writer.close()
        return len(emb.docs)

    return asyncio.run(run())
