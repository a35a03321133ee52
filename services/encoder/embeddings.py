"""Embeddings of a corpus and its queries, encoded once and cached by model and content.

The cache is the benches' (``$GTR_CACHE_DIR``, default ``~/.cache/gtr-retrieval/``): a
file ``<kind>-<n>-<sha256 of model, kind and texts>.npy``, so a changed text, model or
input side is a new file and a repeated run reads the old one in a second. For the
documents, a ``corpus.<model>.npy`` beside the corpus (as in ``../shared/data/scifact``)
is used when its row count matches; it is the same embedding of ``title + " " + text``.
Encoding shows a progress bar (batches of 64, the in-process PyTorch model).

It is the encoder's (it runs the encoder's model and knows its input kinds): the encoder's
training and ``gtr-retrieval eval`` both use it, and eval sits above the encoder (issue #32).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from services.encoder.profiles import Kind

log = logging.getLogger(__name__)

BATCH = 64
Encode = Callable[[list[str], Kind], np.ndarray]


def cache_dir() -> Path:
    return Path(os.environ.get("GTR_CACHE_DIR", Path.home() / ".cache" / "gtr-retrieval"))


def cache_key(model: str, kind: Kind, texts: Sequence[str]) -> str:
    digest = hashlib.sha256(f"{model}\0{kind}\0".encode())
    for text in texts:
        digest.update(text.encode("utf-8"))
        digest.update(b"\0")
    return digest.hexdigest()[:20]


def embed_cached(
    texts: Sequence[str],
    kind: Kind,
    model: str,
    encode: Encode,
    cache: Path | None = None,
    progress: bool = True,
) -> np.ndarray:
    """float32 ``(len(texts), dim)`` embeddings of ``texts``, from the cache or encoded now."""
    folder = cache or cache_dir()
    path = folder / f"{kind}-{len(texts)}-{cache_key(model, kind, texts)}.npy"
    if path.exists():
        vectors = np.load(path)
        if vectors.shape[0] == len(texts):
            return vectors.astype(np.float32, copy=False)
        log.warning("%s: %d rows for %d texts; encoding again", path, vectors.shape[0], len(texts))
    vectors = encode_all(texts, kind, encode, progress, desc=f"encoding {len(texts)} {kind} texts")
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.npy")
    np.save(tmp, vectors)
    tmp.replace(path)
    return vectors


def encode_all(
    texts: Sequence[str], kind: Kind, encode: Encode, progress: bool = True, desc: str = ""
) -> np.ndarray:
    """``encode`` over batches of :data:`BATCH`, with a progress bar on stderr."""
    from tqdm import tqdm

    rows: list[np.ndarray] = []
    with tqdm(
        total=len(texts),
        desc=desc or f"encoding {kind} texts",
        unit="text",
        file=sys.stderr,
        disable=not progress,
    ) as bar:
        for i in range(0, len(texts), BATCH):
            batch = list(texts[i : i + BATCH])
            rows.append(np.asarray(encode(batch, kind), dtype=np.float32))
            bar.update(len(batch))
    if not rows:
        return np.zeros((0, 0), dtype=np.float32)
    return np.ascontiguousarray(np.concatenate(rows), dtype=np.float32)


def beside_corpus(corpus_dir: Path, model: str, rows: int) -> np.ndarray | None:
    """``corpus.<model>.npy`` next to a BEIR corpus, when it has ``rows`` rows."""
    path = Path(corpus_dir) / f"corpus.{model}.npy"
    if not path.exists():
        return None
    vectors = np.load(path)
    if vectors.shape[0] != rows:
        log.warning("%s has %d rows for %d documents: not used", path, vectors.shape[0], rows)
        return None
    return vectors.astype(np.float32, copy=False)


def torch_encoder(threads: int | None = None) -> tuple[str, Encode]:
    """(model name, encode) of the in-process PyTorch model (default all-MiniLM-L6-v2)."""
    from services.encoder.model import TorchEmbedder

    embedder = TorchEmbedder(threads=threads)

    def encode(texts: list[str], kind: Kind) -> np.ndarray:
        return embedder.embed(texts, kind)[0]

    return str(embedder.model_name), encode
